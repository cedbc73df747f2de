"""OpenAI response and stream-chunk bodies for text completions and chat completions."""

from __future__ import annotations

from typing import Any

from fabric.logprobs import finite
from fabric.messages.client import PromptScores
from gateway import structured
from gateway.generation import Choice, Delta, Entry
from gateway.protocol import GenParams


class Formatter:
    """Builds the JSON of one request's responses.

    `chat` picks the chat shapes. `prompts` are the token ids of each prompt. A choice's prompt is
    prompts[index // n].
    """

    def __init__(self, chat: bool, rid: str, created: int, model: str, params: GenParams, tokenizer: Any,
                 prompts: list[list[int]]) -> None:
        self.chat = chat
        self.rid = rid
        self.created = created
        self.model = model
        self.params = params
        self.tok = tokenizer
        self.prompts = prompts
        self._texts: dict[int, str] = {}
        self._tool_text: dict[int, str] = {}  # choice -> its text so far, streamed as tool calls at its end

    def _token_text(self, token: int) -> str:
        text = self._texts.get(token)
        if text is None:
            text = str(self.tok.decode([token], skip_special_tokens=False)) if self.tok is not None else f"<{token}>"
            self._texts[token] = text
        return text

    # -- the prompt (echo, prompt logprobs) ---------------------------------------------------
    def _prompt_text(self, k: int) -> str:
        """Prompt k as the client sent it (text), or its token ids decoded."""
        text = self.params.prompts[k][1]
        if text is not None:
            return text
        ids = self.prompts[k]
        return str(self.tok.decode(ids, skip_special_tokens=False)) if self.tok is not None else \
            "".join(self._token_text(t) for t in ids)

    def _scored(self, k: int, scores: PromptScores | None, top_k: int) -> list[tuple[int, Any]]:
        """Prompt k's tokens after the first, each with its scores.

        The scores are (logprob, rank, top [[id, logprob], ...]), or None where there are none.
        """
        out: list[tuple[int, Any]] = []
        for i, t in enumerate(self.prompts[k][1:]):
            if scores is None or i >= scores.logprobs.shape[0]:
                out.append((t, None))
                continue
            top = [[int(a), finite(float(b))] for a, b in
                   zip(scores.top_ids[i, :top_k].tolist(), scores.top_logprobs[i, :top_k].tolist())]
            out.append((t, (finite(float(scores.logprobs[i])), int(scores.ranks[i]), top)))
        return out

    def _prompt_entries(self, k: int, scores: PromptScores | None) -> list[Entry]:
        """The logprobs entries of prompt k's tokens, as OpenAI echoes them.

        The first token has none.
        """
        out: list[Entry] = [(self.prompts[k][0], None, None)]
        for t, s in self._scored(k, scores, max(self.params.logprobs, 0)):
            out.append((t, None, None) if s is None else (t, s[0], s[2]))
        return out

    def _prompt_logprobs(self, k: int, scores: PromptScores | None) -> list[dict[str, Any] | None]:
        """vLLM's `prompt_logprobs`.

        Each prompt token gets the token itself and the top `prompt_logprobs`, keyed by token id.
        Each entry has its logprob, rank and text. The first prompt token gets null.
        """
        out: list[dict[str, Any] | None] = [None]
        for t, s in self._scored(k, scores, self.params.prompt_logprobs):
            if s is None:
                out.append(None)
                continue
            lp, rank, top = s
            d = {str(t): {"logprob": lp, "rank": rank, "decoded_token": self._token_text(t)}}
            for r, (a, b) in enumerate(top):
                d.setdefault(str(a), {"logprob": b, "rank": r + 1, "decoded_token": self._token_text(int(a))})
            out.append(d)
        return out

    def _completion_item(self, index: int, text: str, entries: list[Entry], scores: PromptScores | None,
                         first: bool, offsets: bool) -> dict[str, Any]:
        """A text-completion choice, whole or a chunk.

        `first` means it starts the choice, which is where echo goes.
        """
        k = index // self.params.n
        if first and self.params.echo:
            text = self._prompt_text(k) + text
            entries = self._prompt_entries(k, scores) + entries
        item: dict[str, Any] = {"index": index, "text": text,
                                "logprobs": self.logprobs(entries, offsets) if entries else None}
        if first and self.params.prompt_logprobs >= 0:
            item["prompt_logprobs"] = self._prompt_logprobs(k, scores)
        return item

    def logprobs(self, entries: list[Entry], offsets: bool = False) -> dict[str, Any] | None:
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
        tokens = [self._token_text(t) for t, _, _ in entries]
        body: dict[str, Any] = {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [None if lp is None else {self._token_text(int(t)): v for t, v in (top or [])}
                             for _, lp, top in entries] if self.params.logprobs > 0 else None,
        }
        if offsets:  # where each token starts in the choice's text
            starts, at = [], 0
            for t in tokens:
                starts.append(at)
                at += len(t)
            body["text_offset"] = starts
        return body

    def usage(self, prompt_tokens: int, choices: list[Choice]) -> dict[str, int]:
        completion = sum(len(c.token_ids) for c in choices)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}

    def whole(self, choices: list[Choice], texts: list[str], logprobs: list[list[Entry]]) -> dict[str, Any]:
        prompts = self.prompts
        out = []
        for c, text, lps in zip(choices, texts, logprobs):
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = c.finish_reason
                calls = self._tool_calls(c.index, text, finish)
                if calls is not None:
                    message, finish = {"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"
                item: dict[str, Any] = {"index": c.index, "message": message,
                                        "logprobs": self.logprobs(lps), "finish_reason": finish}
            else:
                item = self._completion_item(c.index, text, lps, c.prompt, True, True)
                item["finish_reason"] = c.finish_reason
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
        """One streamed chunk.

        `delta` None with `first` is the chat role announcement.
        """
        calls = None
        if self.chat:
            d: dict[str, Any] = {"role": "assistant", "content": ""} if first else {"content": delta.text if delta else ""}
            if self.params.tools_named is not None and delta is not None:
                # Tool calls go out whole, once the choice is complete (its arguments must parse).
                self._tool_text[index] = text = self._tool_text.get(index, "") + delta.text
                d = {}
                calls = self._tool_calls(index, text, delta.finish_reason) if delta.finish_reason else None
                if calls is not None:
                    d = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]}
                elif delta.finish_reason:
                    d = {"content": text}  # (cut short: the text as it is)
            item: dict[str, Any] = {"index": index, "delta": d, "logprobs": None, "finish_reason": None}
        elif delta is not None:
            item = self._completion_item(index, delta.text, delta.logprobs, delta.prompt, delta.index == 0, False)
        else:
            item = {"index": index, "text": "", "logprobs": None}
        item["finish_reason"] = None
        if delta is not None:
            item["finish_reason"] = "tool_calls" if calls is not None else delta.finish_reason
            if self.chat and delta.logprobs:
                item["logprobs"] = self.logprobs(delta.logprobs)
            if self.params.return_token_ids:
                item["token_ids"] = delta.token_ids
        return self._envelope([item])

    def _tool_calls(self, index: int, text: str, finish: str | None) -> list[dict[str, Any]] | None:
        """The choice's tool calls, where the request asked for them and its output is complete."""
        if not self.chat or self.params.tools_named is None or finish != "stop":
            return None
        return structured.tool_calls(structured.Tools(self.params.tools_named), text, f"{self.rid}-{index}")

    def usage_chunk(self, prompt_tokens: int, choices: list[Choice]) -> dict[str, Any]:
        body = self._envelope([])
        body["usage"] = self.usage(prompt_tokens, choices)
        return body

    def _envelope(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": items}
