"""Parsing and validating OpenAI `/v1/completions` bodies; errors are OpenAI error objects."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from aiohttp import web


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)


@dataclass(frozen=True)
class CompletionParams:
    prompt_ids: list[int] | None
    prompt_text: str | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stream: bool
    ignore_eos: bool
    return_token_ids: bool


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be a number in [{lo}, {hi}]", name)
    return float(value)


def _int(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be an integer in [{lo}, {hi}]", name)
    return value


def _bool(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", name)
    return value


def parse_completion(body: Any, vocab_size: int, context: int) -> CompletionParams:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    ids: list[int] | None = None
    text: str | None = None
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", "prompt")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
        ids = list(prompt)
    else:
        raise ApiError(400, "'prompt' must be a non-empty string or a non-empty list of token ids", "prompt")
    n = _int(body, "n", 1, 1, 1)
    assert n == 1
    max_tokens = _int(body, "max_tokens", 16, 1, context)
    assert max_tokens is not None
    seed = _int(body, "seed", None, -(2**63), 2**64 - 1)
    return CompletionParams(
        prompt_ids=ids,
        prompt_text=text,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=int(_number(body, "top_k", -1, -1, vocab_size)),
        seed=seed if seed is not None else secrets.randbits(63),
        stream=_bool(body, "stream"),
        ignore_eos=_bool(body, "ignore_eos"),
        return_token_ids=_bool(body, "return_token_ids"),
    )
