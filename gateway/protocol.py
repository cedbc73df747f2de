"""Parsing and validating OpenAI request bodies; every error is an OpenAI error object."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from fabric.messages.client import Constraint


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, headers=self.headers)


MAX_N = 16  # choices per prompt
MAX_PROMPTS = 64  # prompts in one /v1/completions request (lm-eval batches them)
MAX_STOP = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_DEPTH = 32  # JSON nesting
MAX_INT_DIGITS = 24  # a seed is the largest integer the API takes (2**64)


def _int_literal(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ApiError(400, f"an integer of {len(text)} digits; the API takes none over {MAX_INT_DIGITS}")
    return int(text)


def _const(text: str) -> float:
    raise ApiError(400, f"{text} is not JSON")


def parse_json(raw: bytes) -> Any:
    """Parses a request body as JSON.

    Raises ApiError 400 for anything malformed, nested deeper than MAX_DEPTH, or with an integer
    longer than MAX_INT_DIGITS. Python refuses to convert 4300 digits, which would be a 500.
    """
    try:
        body = json.loads(raw, parse_int=_int_literal, parse_constant=_const)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON body: {exc}") from exc
    except RecursionError:
        raise ApiError(400, f"the JSON body is nested deeper than {MAX_DEPTH} levels") from None
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ApiError(400, f"the JSON body is nested deeper than {MAX_DEPTH} levels")
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return body


@dataclass(frozen=True)
class GenParams:
    """What both endpoints ask of the fabric.

    That is one or more prompts, as token ids or text to tokenize, with `n` choices each.
    """

    prompts: tuple[tuple[list[int] | None, str | None], ...]  # (ids, None) or (None, text)
    max_tokens: int | None  # None: up to the context
    temperature: float
    top_p: float
    top_k: int
    seed: int
    seed_given: bool  # the client chose the seed (else the gateway drew one)
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    return_token_ids: bool
    logprobs: int  # -1: none; 0: sampled token only; k: top k too
    # The prompt back in front of the completion, with its logprobs if `logprobs`.
    echo: bool = False
    # vLLM's `prompt_logprobs`. -1 is none. k is each prompt token's, and the top k.
    prompt_logprobs: int = -1
    # What the output must match (gateway/structured.py), and the request field it came from.
    constraint: Constraint | None = None
    constraint_param: str = ""
    # Chat: the output is tool calls. "" is a list of calls (tool_choice required); a name, that one function's.
    tools_named: str | None = None

    @property
    def choices(self) -> int:
        """Choices in the response, `n` per prompt, prompt by prompt.

        A choice's index is prompt * n + j.
        """
        return len(self.prompts) * self.n

    @property
    def scores(self) -> int:
        """What the fabric scores in the prompt's prefill.

        -1 is nothing. Otherwise it is the top k to keep.
        """
        return max(self.prompt_logprobs, self.logprobs if self.echo else -1)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be a number in [{lo}, {hi}]", name)
    return float(value)


def _int(body: dict[str, Any], name: str, lo: int, hi: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ApiError(400, f"'{name}' must be an integer in [{lo}, {hi}]", name)
    return value


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"'{name}' must be a boolean", name)
    return value


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"'stop' must be a string of 1 to {MAX_STOP_CHARS} characters or a list of up to "
                       f"{MAX_STOP} of them", "stop")
    return tuple(stop)


def _one_prompt(prompt: Any, vocab_size: int, context: int) -> tuple[list[int] | None, str | None]:
    if isinstance(prompt, str) and prompt:
        return None, prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(not 0 <= t < vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {vocab_size})", "prompt")
        if len(prompt) >= context:
            raise ApiError(400, f"the prompt ({len(prompt)} tokens) does not fit the context of {context} tokens",
                           "prompt")
        return list(prompt), None
    raise ApiError(400, "'prompt' must be a non-empty string, a non-empty list of token ids, or a list of up to "
                        f"{MAX_PROMPTS} of either", "prompt")


def _prompts(body: dict[str, Any], vocab_size: int, context: int) -> tuple[tuple[list[int] | None, str | None], ...]:
    """A prompt, or a batch of them (strings or token-id lists), as OpenAI and vLLM take them."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ApiError(400, f"a batch of {len(prompt)} prompts; at most {MAX_PROMPTS} per request", "prompt")
        return tuple(_one_prompt(p, vocab_size, context) for p in prompt)
    return (_one_prompt(prompt, vocab_size, context),)


def _common(body: dict[str, Any], vocab_size: int, context: int, max_tokens: int | None, logprobs: int) -> dict[str, Any]:
    seed = _int(body, "seed", -(2**63), 2**64 - 1)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool)):
        raise ApiError(400, "'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    stream = _bool(body, "stream")
    if options is not None and not stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", "stream_options")
    return dict(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        top_k=_int(body, "top_k", -1, vocab_size) or -1,
        seed=seed if seed is not None else secrets.randbits(63),
        seed_given=seed is not None,
        n=_int(body, "n", 1, MAX_N) or 1,
        stop=_stop(body),
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        ignore_eos=_bool(body, "ignore_eos"),
        return_token_ids=_bool(body, "return_token_ids"),
        logprobs=logprobs,
    )


def parse_completion(body: Any, vocab_size: int, context: int) -> GenParams:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    prompts = _prompts(body, vocab_size, context)
    echo = _bool(body, "echo")
    max_tokens = _int(body, "max_tokens", 0, context)
    if max_tokens == 0 and not echo:
        raise ApiError(400, "'max_tokens' may be 0 only with 'echo': true (scoring the prompt)", "max_tokens")
    lp = _int(body, "logprobs", 0, 20)
    plp = _int(body, "prompt_logprobs", 0, 20)
    return GenParams(prompts=prompts, echo=echo, prompt_logprobs=-1 if plp is None else plp,
                     **_common(body, vocab_size, context, 16 if max_tokens is None else max_tokens, -1 if lp is None else lp))


def parse_tokenize(body: Any) -> tuple[str | None, Any, bool]:
    """Parses vLLM's `POST /tokenize` into (prompt text, messages, add special tokens).

    The prompt text is None with chat messages. Add special tokens defaults to true for a prompt and
    false for messages, as vLLM does.
    """
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if "messages" in body:
        return None, body["messages"], _bool(body, "add_special_tokens", False)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "'prompt' must be a string (or send 'messages')", "prompt")
    return prompt, None, _bool(body, "add_special_tokens", True)


def parse_detokenize(body: Any, vocab_size: int) -> list[int]:
    """Parses vLLM's `POST /detokenize` into the token ids."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ApiError(400, "'tokens' must be a list of token ids", "tokens")
    if any(not 0 <= t < vocab_size for t in tokens):
        raise ApiError(400, f"token ids must be in [0, {vocab_size})", "tokens")
    return tokens


def parse_chat(body: Any, vocab_size: int, context: int) -> tuple[Any, dict[str, Any]]:
    """Returns (raw messages, GenParams fields other than the prompt)."""
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    if "messages" not in body:
        raise ApiError(400, "'messages' is required", "messages")
    max_tokens = _int(body, "max_completion_tokens", 1, context)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1, context)
    top = _int(body, "top_logprobs", 0, 20)
    want = _bool(body, "logprobs")
    if top is not None and not want:
        raise ApiError(400, "'top_logprobs' requires 'logprobs': true", "top_logprobs")
    return body["messages"], _common(body, vocab_size, context, max_tokens, (top or 0) if want else -1)
