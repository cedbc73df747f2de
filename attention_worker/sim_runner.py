"""`--compute sim` for an attention worker.

The scheduler, paged KV cache, checkpoints, expert calls through the REFE and sampling are all
real. The tensor math of a step is replaced by a cost model and deterministic stand-ins. The cost
model is `attention_ms` per layer, blocking as real compute does. With many workers in one process
(`--sim-workers`) it is a sleep that does not block the others, as compute on a device of its own.
The stand-ins:

    hidden     h[t, j] = sin(0.01 * (token + 1) * (j mod 8 + 1) + 0.1 * position)  [T, D]: 8 values a row, repeated
    attention  K and V rows derived from the step's input h, written to every layer's cache and checkpointed like
               real ones
    router     the top-k experts of a row: the first k of one of `ROUTES` fixed random orders of the E experts,
               picked by a hash of (token, position, layer), so k distinct experts that vary from row to row as a
               router's do
    experts    h += Σ weight x expert(h), over the wire to the EWs (sim EWs scale rows by a factor
               of their (layer, expert): expert_worker/sim_executor.py)
    lm head    one-hot logits on a token picked from h (its 8 values), so the output depends on every expert
               that ran

The stand-ins cost what the math they stand for would not on a device: a step's 8 values a row, its routes and its
logits take a few numpy ops (bench/cpu_regions.py measures them), so the zero-compute benchmark measures the fabric.

A row's result depends only on its own token, position and experts. So a stream is identical
whichever AW or EW replica serves it, and failover in a simulation can still be checked token by token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar, cast

import numpy as np
import torch

from attention_worker.forwarding import ForwardingEngine
from attention_worker.glue import TorchGlue
from attention_worker.kv_cache import KVCache
from attention_worker.model_runner import Chunk, ModelRunner, StepState
from fabric.model.attention_weights import AttentionWeights
from fabric.model.config import ModelConfig
from fabric.steps import StepClock

# The picked token's logit; the others are 0. Sampling at any usual temperature picks it.
PEAK = 30.0
ROUTES = 1021  # the router stand-in's orders of the experts (a prime: its hash is taken modulo it)
WIDTH = 8  # the hidden stand-in's distinct values a row (what the lm head stand-in reads)
B = TypeVar("B", torch.Tensor, np.ndarray)


class SimRunner(ModelRunner):
    attends = False  # its attention is the cost model: no RoPE, no masks

    def __init__(self, cfg: ModelConfig, kv: KVCache, refe: ForwardingEngine, attention_ms: float,
                 clock: StepClock | None = None, blocking: bool = True, glue: TorchGlue | None = None) -> None:
        # No weights: nothing reads them. The glue plans and combines each layer's rows as in real serving.
        super().__init__(cfg, cast(AttentionWeights, None), kv, refe, clock=clock, glue=glue)
        self.attention_s = attention_ms / 1000
        self.blocking = blocking
        # The stand-ins in numpy, in float32 (an op ~1 µs, torch's 2-5 on these few rows: the stand-ins are not the
        # fabric's cost). [8] the hidden stand-in's frequencies.
        self.width = min(WIDTH, cfg.hidden_size)
        self.freq = (0.01 * np.arange(1, self.width + 1)).astype(np.float32)  # [8]
        # The routing stand-in: [ROUTES, k] the first k of fixed random orders of the E experts.
        rng = np.random.default_rng(0)
        self.routes = np.argsort(rng.random((ROUTES, cfg.num_experts)), axis=1)[:, : cfg.top_k].astype(np.int64)
        self.layer_keys = np.arange(cfg.num_layers, dtype=np.int64)[:, None] * 1299709  # [L, 1]
        self._logits = np.zeros((0, cfg.vocab_size), np.float32)  # `_one_hot`
        self._even = torch.zeros(0, cfg.top_k)  # `_weights`

    async def _pace(self, step: StepState) -> None:
        """Paces a step when many workers share this process and its loop (not `blocking`).

        Each layer's cost is then a sleep that does not block the others, as compute on a device of
        its own would not."""
        if not self.blocking and self.attention_s:
            assert isinstance(step, SimStep)
            await asyncio.sleep(self.attention_s * ((step.layer + 1 if step.plan else step.layer) - step.first))

    def _begin(self, chunks: list[Chunk]) -> StepState:
        cfg = self.cfg
        meta = self.prepare(chunks)
        ids, pos = meta.ids.numpy(), meta.pos.numpy()  # [T] each
        t = ids.shape[0]
        h8 = (ids + 1).astype(np.float32)[:, None] * self.freq[None, :]  # [T, 8]
        h8 += (np.float32(0.1) * pos.astype(np.float32))[:, None]
        np.sin(h8, out=h8)
        h = np.tile(h8, (1, -(-cfg.hidden_size // self.width)))[:, : cfg.hidden_size]  # [T, D]
        # Every layer's routing, made once a step.
        experts = self.routes[(ids * 7919 + pos * 104729 + self.layer_keys) % ROUTES]  # [L, T, k]
        # The stand-in K and V rows of every layer: each row's every value its h8[:, 0], written to K and V of every
        # layer at once (one op: the stand-in's cost is not the fabric's); the checkpoints read them from there at the
        # step's end, as they do attention's.
        _write_stand_ins(self.kv.kv_all, meta.slots, h8[:, 0])
        return self._advance(SimStep(meta, _as_tensor(h, cfg.torch_dtype), experts=experts, weights=self._weights(t)))

    def _weights(self, t: int) -> torch.Tensor:
        """The router weights' stand-in, 1/k each [t, k]: views of one tensor, made again only for a larger step."""
        k = self.cfg.top_k
        self._even = _at_least(self._even, t, lambda rows: torch.full((rows, k), 1.0 / k))
        return self._even[:t]

    def _advance(self, step: StepState) -> StepState:
        assert isinstance(step, SimStep)
        cfg, meta = self.cfg, step.meta
        step.first = step.layer
        for i in range(step.layer, cfg.num_layers):
            step.layer = i
            if self.attention_s and self.blocking:
                time.sleep(self.attention_s)  # the cost model, blocking as real compute does
            if i in cfg.dense_layers:
                continue
            step.plan = self.glue.plan(i, step.h, torch.from_numpy(step.experts[i]), step.weights, cfg.num_experts)
            return step
        step.layer = cfg.num_layers
        s = meta.sample_rows.numel()
        rows = torch.cat([meta.sample_rows, meta.score_rows]) if meta.score_rows.numel() else meta.sample_rows
        head = step.h[:, : self.width].float().numpy()[rows.numpy()]  # [S + R, 8]
        out = self._one_hot(np.floor(head * 1000).astype(np.int64).sum(1) % cfg.vocab_size)  # [S + R, V]
        step.logits, step.scored = out[:s], out[s:]
        return step

    def _one_hot(self, picked: np.ndarray) -> torch.Tensor:
        """[n, V] float32 logits: PEAK at each row's picked token, 0 elsewhere.

        They are rows of one buffer kept from step to step, so they hold until the next step's (the engine is done
        with a step's logits when it asks for the next). Fresh memory each step cost a page fault every 4 KiB, ~100 µs
        at 32 rows of 8192; the buffer is zeroed whole each time, as the engine may write into the rows it was given
        (a grammar's mask)."""
        n = picked.shape[0]
        self._logits = _at_least(self._logits, n, lambda rows: np.zeros((rows, self.cfg.vocab_size), np.float32))
        out = self._logits[:n]
        out.fill(0)
        out[np.arange(n), picked] = PEAK
        return torch.from_numpy(out)


def _at_least(buf: B, n: int, make: Callable[[int], B]) -> B:
    """`buf`, or where it has fewer than `n` rows a new one from `make(rows)`, at least twice as many: a buffer kept
    from step to step grows a few times, not at every larger step."""
    return buf if buf.shape[0] >= n else make(max(n, 2 * buf.shape[0]))


def _write_stand_ins(cache: torch.Tensor, slots: torch.Tensor, values: np.ndarray) -> None:
    """cache [2, L, S, K, d][:, :, slots] = values [T] float32, each row's every K and V value in every layer its one.

    On the host numpy's assignment broadcasts the values in one op (a fifth of `index_copy_`'s time, which takes
    TensorIterator's slow path for rows broadcast over layers); a 2-byte dtype, which numpy lacks, as bits."""
    if cache.is_cpu and cache.dtype == torch.float32:
        cache.numpy()[:, :, slots.numpy()] = values[:, None, None]
        return
    rows = torch.from_numpy(np.ascontiguousarray(values)).to(cache.dtype)[:, None, None]  # [T, 1, 1]
    if cache.is_cpu and cache.element_size() == 2:
        cache.view(torch.int16).numpy()[:, :, slots.numpy()] = rows.view(torch.int16).numpy()
        return
    rows = rows.to(cache.device)
    cache.index_copy_(2, slots.to(cache.device), rows.expand(*cache.shape[:2], slots.shape[0], *cache.shape[3:]))


def _as_tensor(h: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The hidden stand-in [T, D] as a tensor of the model's dtype (itself, uncopied, where it is float32 and whole)."""
    t = torch.from_numpy(np.ascontiguousarray(h))
    return t if t.dtype == dtype else t.to(dtype)


@dataclass
class SimStep(StepState):
    experts: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.int64))  # [L, T, k] each layer's experts
    weights: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [T, k] router weights (1/k each)
    # The first layer the last compute call ran, for the inline cost model's sleep.
    first: int = 0
