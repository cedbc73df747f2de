"""`--compute sim` for an attention worker.

The scheduler, paged KV cache, checkpoints, expert calls through the REFE and sampling are all
real. The tensor math of a step is replaced by a cost model and deterministic stand-ins. The cost
model is `attention_ms` per layer, blocking as real compute does. With many workers in one process
(`--sim-workers`) it is a sleep that does not block the others, as compute on a device of its own.
The stand-ins:

    hidden     h[t] = sin(0.01 * (token + 1) * (j + 1) + 0.1 * position)  [T, D]
    attention  K and V rows derived from the step's input h, written to every layer's cache and checkpointed like
               real ones
    router     the top-k experts of a row: the k largest of E pseudo-random scores, hashes of (token,
               position, layer, expert), so k distinct experts that vary from row to row as a router's do
    experts    h += Σ weight x expert(h), over the wire to the EWs (sim EWs scale rows by a factor
               of their (layer, expert): expert_worker/sim_executor.py)
    lm head    one-hot logits on a token picked from h (8 of its values), so the output depends on
               every expert that ran

A row's result depends only on its own token, position and experts. So a stream is identical
whichever AW or EW replica serves it, and failover in a simulation can still be checked token by token.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import cast

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
_P = 1_000_003  # a prime: the routing scores are products modulo it


class SimRunner(ModelRunner):
    attends = False  # its attention is the cost model: no RoPE, no masks

    def __init__(self, cfg: ModelConfig, kv: KVCache, refe: ForwardingEngine, attention_ms: float,
                 clock: StepClock | None = None, blocking: bool = True, glue: TorchGlue | None = None) -> None:
        # No weights: nothing reads them. The glue plans and combines each layer's rows as in real serving.
        super().__init__(cfg, cast(AttentionWeights, None), kv, refe, clock=clock, glue=glue)
        self.attention_s = attention_ms / 1000
        self.blocking = blocking
        # The stand-ins in numpy, in float32 (an op ~1 µs, torch's 2-5 on these few rows: the stand-ins are not the
        # fabric's cost). [D] the hidden state's frequencies.
        self.freq = (0.01 * np.arange(1, cfg.hidden_size + 1)).astype(np.float32)
        # The routing stand-in: [E] a multiplier each expert (distinct mod P), the tie-breaker in a score's low digits.
        self.mults = (np.arange(cfg.num_experts, dtype=np.int64) * 40503 + 7919) % _P
        self.ties = np.arange(cfg.num_experts, dtype=np.int64)
        self.layer_keys = np.arange(cfg.num_layers, dtype=np.int64)[:, None] * 1299709  # [L, 1]
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
        h = (ids + 1).astype(np.float32)[:, None] * self.freq[None, :]  # [T, D]
        h += (np.float32(0.1) * pos.astype(np.float32))[:, None]
        np.sin(h, out=h)
        # Every layer's routing, made once a step: its top-k, largest first (a row's scores are distinct).
        key = (ids * 7919 + pos * 104729 + self.layer_keys) % _P + 1  # [L, T]
        scores = (key[:, :, None] * self.mults % _P) * cfg.num_experts + self.ties  # [L, T, E]
        experts = np.ascontiguousarray(np.argsort(-scores, axis=2)[:, :, : cfg.top_k])  # [L, T, k]
        # The stand-in K and V rows of every layer, written to every layer's cache at once (one op each: the stand-in's
        # cost is not the fabric's) and handed to the checkpoints at the step's end, each layer's, as attention's are.
        kv = torch.from_numpy(np.repeat(h[:, :1], self.kv_size, axis=1)).view(t, cfg.num_kv_heads, cfg.head_dim)
        kv = kv.to(cfg.torch_dtype)
        _write_every_layer(self.kv.k_all, meta.slots, kv)
        _write_every_layer(self.kv.v_all, meta.slots, kv)
        return self._advance(SimStep(meta, torch.from_numpy(h).to(cfg.torch_dtype), experts=experts,
                                     weights=self._weights(t), stand_in_kv=kv))

    def _weights(self, t: int) -> torch.Tensor:
        """The router weights' stand-in, 1/k each [t, k]: views of one tensor, made again only for a larger step."""
        if self._even.shape[0] < t:
            self._even = torch.full((max(t, 2 * self._even.shape[0]), self.cfg.top_k), 1.0 / self.cfg.top_k)
        return self._even[:t]

    def _advance(self, step: StepState) -> StepState:
        assert isinstance(step, SimStep)
        cfg, meta = self.cfg, step.meta
        step.first = step.layer
        for i in range(step.layer, cfg.num_layers):
            step.layer = i
            if self.attention_s and self.blocking:
                time.sleep(self.attention_s)  # the cost model, blocking as real compute does
            kv = step.stand_in_kv
            step.kv.append((i, kv, kv))
            if i in cfg.dense_layers:
                continue
            step.plan = self.glue.plan(i, step.h, torch.from_numpy(step.experts[i]), step.weights, cfg.num_experts)
            return step
        step.layer = cfg.num_layers
        s = meta.sample_rows.numel()
        rows = torch.cat([meta.sample_rows, meta.score_rows]) if meta.score_rows.numel() else meta.sample_rows
        head = step.h[:, :8].float().numpy()[rows.numpy()]  # [S + R, 8]
        picked = np.floor(head * 1000).astype(np.int64).sum(1) % cfg.vocab_size  # [S + R]
        logits = np.zeros((len(picked), cfg.vocab_size), np.float32)
        logits[np.arange(len(picked)), picked] = PEAK
        out = torch.from_numpy(logits)
        step.logits, step.scored = out[:s], out[s:]
        return step


def _write_every_layer(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """cache [L, S, K, d][:, slots] = rows [T, K, d], in every layer. On the host numpy's assignment takes a fifth of
    `index_copy_`'s time with the rows broadcast over the layers (4.6 µs against 24 at 32 rows), on a bit view of a
    2-byte dtype numpy lacks; elsewhere `index_copy_`."""
    if cache.device.type != "cpu":
        cache.index_copy_(1, slots, rows.expand(cache.shape[0], *rows.shape))
        return
    if cache.element_size() == 2:
        cache, rows = cache.view(torch.int16), rows.view(torch.int16)
    cache.numpy()[:, slots.numpy()] = rows.numpy()


@dataclass
class SimStep(StepState):
    experts: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0), np.int64))  # [L, T, k] each layer's experts
    weights: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [T, k] router weights (1/k each)
    stand_in_kv: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # [T, K, d] every layer's K and V
    # The first layer the last compute call ran, for the inline cost model's sleep.
    first: int = 0
