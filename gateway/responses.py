"""OpenAI response and stream-chunk bodies for text completions and chat completions."""

from __future__ import annotations

from typing import Any

from gateway.generation import Choice, Delta
from gateway.protocol import GenParams


class Formatter:
    """Builds the JSON of one request's responses; `chat` picks the chat shapes."""

    def __init__(self, chat: bool, rid: str, created: int, model: str, params: GenParams, tokenizer: Any) -> None:
        self.chat = chat
        self.rid = rid
        self.created = created
        self.model = model
        self.params = params
        self.tok = tokenizer

    def _token_text(self, token: int) -> str:
        return str(self.tok.decode([token], skip_special_tokens=False)) if self.tok is not None else f"<{token}>"

    def logprobs(self, entries: list[tuple[int, float, list[list[float]] | None]]) -> dict[str, Any] | None:
        if self.params.logprobs < 0:
            return None
        if self.chat:
            content = []
            for token, lp, top in entries:
                text = self._token_text(token)
                content.append({
                    "token": text, "logprob": lp, "bytes": list(text.encode()),
                    "top_logprobs": [{"token": self._token_text(int(t)), "logprob": v,
                                      "bytes": list(self._token_text(int(t)).encode())} for t, v in (top or [])],
                })
            return {"content": content}
        return {
            "tokens": [self._token_text(t) for t, _, _ in entries],
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [{self._token_text(int(t)): v for t, v in (top or [])} for _, _, top in entries]
            if self.params.logprobs > 0 else None,
        }

    def usage(self, prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

    def whole(self, prompts: list[list[int]], choices: list[Choice], texts: list[str],
              logprobs: list[list[tuple[int, float, list[list[float]] | None]]]) -> dict[str, Any]:
        out = []
        for c, text, lps in zip(choices, texts, logprobs):
            if self.chat:
                item: dict[str, Any] = {"index": c.index, "message": {"role": "assistant", "content": text},
                                        "logprobs": self.logprobs(lps), "finish_reason": c.finish_reason}
            else:
                item = {"index": c.index, "text": text, "logprobs": self.logprobs(lps), "finish_reason": c.finish_reason}
            if self.params.return_token_ids:
                item["token_ids"] = c.token_ids
                if len(prompts) > 1:  # each choice's own prompt, as vLLM returns a batch's
                    item["prompt_token_ids"] = prompts[c.index // self.params.n]
            out.append(item)
        body: dict[str, Any] = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                                "created": self.created, "model": self.model, "choices": out,
                                "usage": self.usage(sum(len(ids) for ids in prompts), choices)}
        if self.params.return_token_ids and len(prompts) == 1:
            body["prompt_token_ids"] = prompts[0]
        return body

    def chunk(self, index: int, delta: Delta | None, first: bool = False) -> dict[str, Any]:
        """One streamed chunk; `delta` None with `first` is the chat role announcement."""
        if self.chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {"content": delta.text if delta else ""}
            item: dict[str, Any] = {"index": index, "delta": d, "logprobs": None, "finish_reason": None}
        else:
            item = {"index": index, "text": delta.text if delta else "", "logprobs": None, "finish_reason": None}
        if delta is not None:
            item["finish_reason"] = delta.finish_reason
            if delta.logprobs:
                item["logprobs"] = self.logprobs(delta.logprobs)
            if self.params.return_token_ids:
                item["token_ids"] = delta.token_ids
        return self._envelope([item])

    def usage_chunk(self, prompt_tokens: int, choices: list[Choice]) -> dict[str, Any]:
        body = self._envelope([])
        body["usage"] = self.usage(prompt_tokens, choices)
        return body

    def _envelope(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": items}
