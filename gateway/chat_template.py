"""Renders chat messages with the model's own template (`tokenizer_config.json`).

As in transformers, it uses a sandboxed jinja2 environment with trim_blocks/lstrip_blocks and a
`raise_exception` helper. A template error is the request's fault (400), never the gateway's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.protocol import ApiError

ROLES = ("system", "developer", "user", "assistant", "tool")


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, special: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(source)
        self.special = special

    @classmethod
    def from_model_dir(cls, model_dir: str) -> ChatTemplate | None:
        path = Path(model_dir) / "tokenizer_config.json"
        if not path.exists():
            return None
        cfg = json.loads(path.read_text())
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: take "default"
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            return None
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(source, {k: v for k, v in special.items() if v is not None})

    def render(self, messages: list[dict[str, Any]]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True, **self.special)
        except TemplateError as exc:
            raise ApiError(400, f"the chat template rejected these messages: {exc}", "messages") from exc


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def validate_messages(raw: Any) -> list[dict[str, Any]]:
    """Validates OpenAI chat messages into [{"role", "content": str}].

    Content parts of type text are joined.
    """
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object", f"messages[{i}]")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}", f"messages[{i}].role")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(400, f"messages[{i}].content parts must be text parts", f"messages[{i}].content")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None and role == "assistant":
            content = ""
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        out.append({"role": role, "content": content})
    return out
