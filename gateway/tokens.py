"""The gateway's tokenizer: loading it, and tokenizing (or rendering a chat) off the loop when long."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def load_tokenizer(model_dir: str) -> Any:
    path = Path(model_dir) / "tokenizer.json"
    if not path.exists():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


# Longer prompts are tokenized, and chats rendered, in a thread.
OFF_LOOP_CHARS = 16 << 10
# A prompt longer than this many characters per token of the context cannot fit it. It is refused
# before it is tokenized. A token spans a few characters; 64 leaves room for runs of whitespace.
# A 6 MiB prompt took the tokenizer 8 s. Turning its 1.2M ids into Python held the GIL long enough
# to silence the gateway's control thread past its lease.
MAX_CHARS_PER_TOKEN = 64


async def off_loop(fn: Callable[[], T], size: int) -> T:
    """Runs `fn` on the event loop when `size` is small, else in a thread.

    A multi-MiB prompt takes seconds to tokenize. Meanwhile the loop must keep serving every other
    stream and pinging its supervisor's watchdog.
    """
    if size <= OFF_LOOP_CHARS:
        return fn()
    return await asyncio.to_thread(fn)
