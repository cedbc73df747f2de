"""Paged KV cache: fixed-size blocks, a free list, and per-layer K/V storage.

Legend: B blocks, S block size, K kv heads, d head dim. A token at position p of a sequence lives
in slot `block_table[p // S] * S + p % S` of the flat [B*S, K, d] view.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fabric.model.config import ModelConfig


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))
        # Called before blocks are freed: the checkpointer gathers from the cache the steps it holds and queues.
        self.before_release: Callable[[], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_needed(self, table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(table))

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extends `table` to hold `num_tokens`. Returns False, with no change, if blocks ran out."""
        need = self.blocks_needed(table, num_tokens)
        if need > len(self._free):
            return False
        for _ in range(need):
            table.append(self._free.pop())
        return True

    def reserve(self) -> int:
        """Takes a block for good (the free one handed out last; at start-up the highest): no sequence gets it. An
        AW's CUDA graphs pad with it."""
        if not self._free:
            raise RuntimeError("no free KV block to reserve")
        return self._free.pop(0)

    def release(self, table: list[int]) -> None:
        if table and self.before_release is not None:
            self.before_release()
        self._free.extend(reversed(table))
        table.clear()


class KVCache:
    def __init__(self, cfg: ModelConfig, block_size: int, budget_bytes: int,
                 device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * cfg.torch_dtype.itemsize
        num_blocks = max(1, budget_bytes // per_block)
        self.blocks = BlockManager(num_blocks, block_size)
        shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)  # [L, B*S, K, d]
        # K and V of every layer in one tensor [2, L, B*S, K, d], so that a read or write of the same slots in all
        # layers is one op (a restore, a store's re-send; the simulator's stand-ins, K and V together). `k_all` and
        # `v_all` are its halves [L, B*S, K, d], and `k[i]` and `v[i]` layer i's [B*S, K, d]: views.
        self.kv_all = torch.zeros((2, *shape), dtype=cfg.torch_dtype, device=self.device)
        self.k_all, self.v_all = self.kv_all.unbind(0)
        self.k = list(self.k_all.unbind(0))
        self.v = list(self.v_all.unbind(0))

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        s = self.blocks.block_size
        return [table[p // s] * s + p % s for p in range(start, end)]
