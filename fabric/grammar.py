"""Constrained decoding: a grammar a request's output must match, as a mask over the vocabulary.

The gateway turns `response_format`, `structured_outputs` and tool choices into a `Constraint`
(fabric/messages/client.py) and compiles it once, in bounded time, to refuse a bad one with a
400. The AW compiles it again (cached), off its loop, and keeps a matcher per request: before
each sampling the matcher's mask sets the disallowed logits to -inf, after it the token
advances the matcher. A request resumed elsewhere rebuilds its matcher from its tokens, so its
masks, and its tokens, are those of the failure-free run.

The grammar engine is xgrammar (the `structured` extra). It lets a JSON string hold raw control
bytes, which JSON forbids: JSON kinds also mask every token with a byte below 0x20.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from fabric.errors import FabricError
from fabric.messages.client import Constraint

if TYPE_CHECKING:
    import torch  # (imported where used: a gateway that is asked for no grammar never loads it)

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
JSON_KINDS = ("json_schema", "json_object")
MAX_SPEC_CHARS = 64 << 10  # a schema, regex or grammar longer than this is refused unread
COMPILE_TIMEOUT_S = 5.0  # a grammar that takes longer to compile is refused (the compile runs on, in its thread)
MAX_COMPILES = 4  # compile threads a process has (`CompileSlots`)
T = TypeVar("T")


class ConstraintError(FabricError):
    """A constraint that cannot be compiled: the request's fault (a 400 naming `param`)."""

    recoverable = True

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


class GrammarBusyError(FabricError):
    """Every compile thread of this process is held by a compile that outlasted its deadline (as a flood of
    costly grammars leaves them): the request is refused at once, not queued (a 503: the server's state, not
    the request's fault)."""

    recoverable = True


class CompileSlots:
    """Where a process's grammar compiles run: `n` threads of their own, never the loop's default executor
    (which the gateway's tokenizing and the rest share, and which stuck compiles would fill).

    Compiles queue for a thread, within their deadline. A compile cannot be stopped: one that outlasts its
    deadline is refused to its caller but keeps its thread until it ends (`stuck`). With every thread stuck,
    `run` refuses at once (`GrammarBusyError`) instead of queueing behind them."""

    def __init__(self, n: int = MAX_COMPILES) -> None:
        self.n = n
        self._pool = ThreadPoolExecutor(n, thread_name_prefix="grammar-compile")
        self._stuck = 0
        self._lock = threading.Lock()

    @property
    def stuck(self) -> int:
        """Compiles running past their deadline now."""
        with self._lock:
            return self._stuck

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a compile thread; TimeoutError past COMPILE_TIMEOUT_S (its wait for a thread
        included), GrammarBusyError if every thread is stuck."""
        with self._lock:
            if self._stuck >= self.n:
                raise GrammarBusyError(f"the grammar compiler is busy: all {self.n} of its threads are held by "
                                       f"compiles past their deadline; retry later")
        fut = self._pool.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), COMPILE_TIMEOUT_S)
        except TimeoutError:
            if not fut.cancelled():  # (one still queued was cancelled; one running cannot be)
                with self._lock:
                    self._stuck += 1
                fut.add_done_callback(self._unstick)
            raise

    def _unstick(self, _: Future[Any]) -> None:
        with self._lock:
            self._stuck -= 1


COMPILES = CompileSlots()  # this process's


def available() -> bool:
    """Whether the grammar engine is installed (not imported: that takes seconds, see `grammars_for`)."""
    return importlib.util.find_spec("xgrammar") is not None


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class Grammars:
    """One model's tokenizer as the grammar engine sees it, its compiled grammars (cached) and the
    mask of tokens that hold a control byte. Thread-safe: compiles run in worker threads."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: list[int]) -> None:
        import torch
        import xgrammar as xgr

        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise ConstraintError("this model has no tokenizer.json: structured outputs need one")
        backend = path.read_text()
        parsed = json.loads(backend)
        vocab: dict[str, int] = parsed["model"]["vocab"]
        added = parsed.get("added_tokens", [])
        for tok in added:
            vocab[tok["content"]] = tok["id"]
        encoded = [""] * vocab_size
        for text, i in vocab.items():
            if i < vocab_size:
                encoded[i] = text
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(backend)
        vocab_type = xgr.VocabType(meta["vocab_type"])
        info = xgr.TokenizerInfo(encoded, vocab_type, vocab_size=vocab_size,
                                 stop_token_ids=stop_token_ids, add_prefix_space=bool(meta["add_prefix_space"]))
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._lock = threading.Lock()
        # [ceil(V / 32)] int32: bit t set where token t holds no byte below 0x20 (specials: kept)
        special = {t["id"] for t in added}
        dec = _byte_decoder() if vocab_type == xgr.VocabType.BYTE_LEVEL else {}
        allowed = torch.ones(vocab_size, dtype=torch.bool)
        for i, text in enumerate(encoded):
            if i in special or not text:
                continue
            raw = [dec.get(c, ord(c) if ord(c) < 256 else 0x20) for c in text] if dec else [ord(c) for c in text]
            if any(b < 0x20 for b in raw):
                allowed[i] = False
        self.json_mask = _pack(allowed)

    def compile(self, c: Constraint) -> Any:
        """The compiled grammar of `c` (cached by the engine); raises ConstraintError."""
        if c.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {c.kind!r}")
        if len(c.spec) > MAX_SPEC_CHARS:
            raise ConstraintError(f"the {c.kind} is over {MAX_SPEC_CHARS} characters")
        comp = self._compiler
        try:
            if c.kind == "json_object":  # (an object, as OpenAI's json_object is; not any JSON value)
                return comp.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if c.kind == "json_schema":
                return comp.compile_json_schema(c.spec, any_whitespace=False, strict_mode=True)
            if c.kind == "regex":
                return comp.compile_regex(c.spec)
            if c.kind == "choice":
                choices = json.loads(c.spec)
                if not isinstance(choices, list) or not choices or not all(isinstance(x, str) for x in choices):
                    raise ConstraintError("'choice' must be a non-empty list of strings")
                alts = " | ".join(json.dumps(x) for x in choices)
                return comp.compile_grammar(f"root ::= {alts}")
            return comp.compile_grammar(c.spec)
        except ConstraintError:
            raise
        except Exception as exc:  # the engine's own errors: a bad schema, regex or grammar
            raise ConstraintError(f"invalid {c.kind}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
                from None

    def matcher(self, c: Constraint, tokens: list[int]) -> Matcher:
        """A matcher for `c`, advanced over `tokens` (those of a resumed request)."""
        m = Matcher(self, c, self.compile(c))
        for t in tokens:
            m.advance(t)
        return m


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, grammars: Grammars, c: Constraint, compiled: Any) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self._m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        self._bits = xgr.allocate_token_bitmask(1, grammars.vocab_size)
        self._json = grammars.json_mask if c.kind in JSON_KINDS else None
        self.broken = False  # a token the grammar refused (cannot happen when every token was masked)

    def fill(self, bits: torch.Tensor, row: int) -> None:
        """Writes the tokens the grammar allows next into row `row` of `bits` [B, ceil(V / 32)] int32."""
        self._m.fill_next_token_bitmask(bits, row)
        if self._json is not None:
            bits[row, : self._json.shape[0]] &= self._json

    def mask(self, logits: torch.Tensor) -> None:
        """Sets the logits [V] of the tokens the grammar forbids next to -inf, in place."""
        self.fill(self._bits, 0)
        apply(logits, self._bits[0])

    def advance(self, token: int) -> None:
        if not self._m.accept_token(token):
            self.broken = True

    @property
    def done(self) -> bool:
        """The output is complete: the grammar takes no more tokens."""
        return bool(self._m.is_terminated())


def bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32, every token allowed."""
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """Sets logits [V] to -inf where `bits` [ceil(V / 32)] has the token's bit clear, in place."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits.view(1, -1), bits.view(1, -1))


def _pack(allowed: torch.Tensor) -> torch.Tensor:
    """[V] bool -> [ceil(V / 32)] int32, bit t % 32 of word t // 32 (the engine's bitmask layout)."""
    import torch

    v = allowed.shape[0]
    padded = torch.zeros((v + 31) // 32 * 32, dtype=torch.int64)
    padded[:v] = allowed.to(torch.int64)
    weights = torch.tensor([1 << i for i in range(32)], dtype=torch.int64)
    words = (padded.view(-1, 32) * weights).sum(dim=1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


_built: dict[tuple[str, int, tuple[int, ...]], Grammars] = {}
_building = threading.Lock()


def grammars_for(model_dir: str, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Grammars:
    """The model's `Grammars`, built once. Call it in a thread, never on an event loop: the first
    call imports the engine (1.7 s here, most of it transformers, which xgrammar imports), and a
    loop that waits that long misses its watchdog. Concurrent first calls wait for one build."""
    key = (model_dir, vocab_size, stop_token_ids)
    with _building:
        g = _built.get(key)
        if g is None:
            g = _built[key] = Grammars(model_dir, vocab_size, list(stop_token_ids))
    return g
