"""One forward step of a mixed prefill/decode batch on the AW; experts go through the REFE.

A step is a run of compute calls. Each goes from a MoE layer's expert results to the next MoE
layer's routing. Between calls, the REFE sends the expert calls and awaits them (`forward`). The
compute runs here, on the data plane's loop. The worker's liveness is its control plane's
(fabric/control_plane.py), which answers during any step, a cold first one included.

Legend: T tokens in the step, Bd decode sequences, L kv length, D hidden, H heads, K kv heads,
d head dim, V vocab.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from attention_worker.forwarding import ForwardingEngine
from attention_worker.glue import TorchGlue
from attention_worker.kv_cache import KVCache
from attention_worker.layer_plan import LayerPlan, Part
from attention_worker.request import Sequence
from fabric import cpu_regions, trace
from fabric.device import to_device_all, to_host
from fabric.kernels.choose import DecodeAttention
from fabric.model.attention_weights import AttentionWeights, LayerWeights
from fabric.model.config import ModelConfig
from fabric.model.ops import rope_cos_sin, rope_inv_freq
from fabric.steps import StepClock

if TYPE_CHECKING:
    from attention_worker.cuda_graphs import LayerGraphs


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables, each padded with -1 to the longest -> [B, Tb]."""
    widest = max(map(len, tables), default=0)
    flat: list[int] = []
    for t in tables:
        flat += t
        if len(t) < widest:
            flat += [-1] * (widest - len(t))
    return torch.from_numpy(np.array(flat, dtype=np.int64)).view(len(tables), widest)


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache [B*S, K, d] at `slots` [*shape] -> [*shape, K, d].

    The same copy as `cache[slots]`. `index_select` on the flattened slots is 5-7x faster on CPU
    than advanced indexing. A decode step's KV gather takes 30 us instead of 200 us per layer and
    tensor, at 8 x 112 slots."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


@dataclass
class Chunk:
    """`n` tokens of `seq` starting at position `start` are fed this step."""

    seq: Sequence
    start: int
    n: int

    @property
    def samples(self) -> bool:
        return self.start + self.n == self.seq.num_tokens


@dataclass
class StepMeta:
    ids: torch.Tensor  # [T]
    pos: torch.Tensor  # [T] positions
    cos: torch.Tensor  # [T, d]
    sin: torch.Tensor  # [T, d]
    slots: torch.Tensor  # [T] flat cache slots of the new tokens
    dec_rows: torch.Tensor  # [Bd] rows of decode tokens
    # [Bd, Tb] block tables of the decode tokens' sequences, padded with -1.
    dec_tables: torch.Tensor
    # [Bd] how many tokens' KV each decode token sees, its own included.
    dec_lens: torch.Tensor
    # [Bd, L] cache slots each decode token attends to, padded. Torch's path only.
    dec_kv: torch.Tensor | None
    dec_mask: torch.Tensor | None  # [Bd, 1, 1, L] bool; torch's path only
    prefills: list[tuple[int, int, torch.Tensor, torch.Tensor]]  # (row, n, kv slots [L], mask [n, L])
    all_decode: bool  # every row is a decode token, in order (dec_rows is 0..T-1)
    sample_rows: torch.Tensor  # [S]
    # [R] rows whose logits score the prompt token after them (prompt_logprobs).
    score_rows: torch.Tensor
    spans: list[tuple[str, int, int]]  # (request, first token, tokens) per chunk, in row order

    def to(self, device: torch.device) -> StepMeta:
        """Its tensors on `device`. They are built on the host, so on the host it returns itself."""
        if device.type == "cpu":
            return self
        names = [f.name for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        flat = [getattr(self, n) for n in names] + [t for _, _, slots, mask in self.prefills for t in (slots, mask)]
        moved = to_device_all(flat, device)  # a copy per dtype, not per tensor
        rest = iter(moved[len(names):])
        prefills = [(row, n, next(rest), next(rest)) for row, n, _, _ in self.prefills]
        fields: dict[str, Any] = dict(zip(names, moved))
        return dataclasses.replace(self, **fields, prefills=prefills)


Routed = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # a MoE layer's input x [T, D], weights, experts [T, k]
# A whole step's spans (request, first token, tokens) and the cache slots [T] its rows wrote in every layer.
KvSink = Callable[[list[tuple[str, int, int]], torch.Tensor], None]


@dataclass
class StepState:
    """A step between two compute calls: where it stands in the layers."""

    meta: StepMeta
    h: torch.Tensor  # [T, D] the residual stream
    # The next layer to run. With `plan`, the layer whose experts are awaited.
    layer: int = 0
    plan: LayerPlan | None = None
    logits: torch.Tensor | None = None  # [S, V] once the last layer is done
    scored: torch.Tensor | None = None  # [R, V]


class ModelRunner:
    # Whether its layers attend. A cost model's stand-ins do not, and need no attention metadata (RoPE, masks).
    attends = True

    def __init__(self, cfg: ModelConfig, weights: AttentionWeights, kv: KVCache, refe: ForwardingEngine,
                 paged: DecodeAttention | None = None, clock: StepClock | None = None,
                 slow: Callable[[], None] | None = None, glue: TorchGlue | None = None, rowwise: bool = False) -> None:
        self.cfg = cfg
        # RMSNorm, the residual adds, RoPE with the cache writes, the router's top-k, the plan and the
        # combine: torch's ops, or one kernel call each (attention_worker/glue.py).
        self.glue = glue or TorchGlue(cfg.rms_norm_eps)
        self.w = weights
        self.kv = kv
        self.refe = refe
        # The control plane's watchdog reads how long a call has run.
        self.clock = clock or StepClock()
        self.slow = slow  # the test-only fault hook: once per step
        # Decode attention that reads each decode token's K/V from its blocks. It is the CPU's
        # fabric/kernels/paged_attention.cpp, or Triton's. With None, torch's path gathers into a
        # padded copy, then runs SDPA.
        self.paged = paged
        # Whether a prefill's rows take `paged` too, each a decode token of its own, so that a token's attention is the
        # same however it was batched (fabric/kernels/choose.py, `prefills_rowwise`); else SDPA over each chunk.
        self.rowwise = rowwise and paged is not None
        self.scale = cfg.head_dim ** -0.5  # SDPA's default, which torch's path uses
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
        # Wall time spent awaiting expert calls, cumulative, for stats.
        self.expert_wait_s = 0.0
        self.forward_s = 0.0
        # The checkpointer's async_update. It is called on the event loop with (layer, spans,
        # k [T, K, d], v) once a layer's KV is in the cache. It must return at once.
        self.kv_sink: KvSink | None = None
        # CUDA graphs of pure decode steps' layers (attention_worker/cuda_graphs.py), where the AW has them.
        self.graphs: LayerGraphs | None = None

    def _mask(self, q_pos: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Causal (and sliding-window) mask [n, L] for query positions `q_pos` [n]."""
        kv_pos = torch.arange(kv_len)
        mask = kv_pos[None, :] <= q_pos[:, None]
        if self.cfg.sliding_window:
            mask &= kv_pos[None, :] > q_pos[:, None] - self.cfg.sliding_window
        return mask

    def _dense_decode(self, tables: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tables [Bd, Tb] (padded with -1), lens [Bd] -> cache slots [Bd, L] and mask [Bd, 1, 1, L].

        L is the longest length. Slots are 0 past a token's length. A decode token is its sequence's
        last, so it sees every position before its length, within the window."""
        bd = lens.numel()
        lmax = int(lens.max()) if bd else 0
        if not lmax:
            return torch.zeros(bd, 0, dtype=torch.long), torch.zeros(bd, 1, 1, 0, dtype=torch.bool)
        bs = self.kv.blocks.block_size
        pos = torch.arange(lmax)  # [L]
        blocks = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1).expand(bd, lmax))  # [Bd, L]
        valid = pos[None, :] < lens[:, None]  # [Bd, L]
        mask = valid & (pos[None, :] > lens[:, None] - 1 - self.cfg.sliding_window) if self.cfg.sliding_window else valid
        return torch.where(valid, blocks * bs + pos % bs, 0), mask[:, None, None, :]

    def prepare(self, chunks: list[Chunk]) -> StepMeta:
        """The step's metadata, built on the host.

        A decode chunk (one token) takes a few list appends. Every index of the step then becomes one int64 array in
        one call, split into its tensors in one more; the block tables another array (numpy's from a list is 3x
        torch's: 3 against 9 µs for 192 ints, 10 against 30 for 32 tables of 19). A runner that does not attend (the
        simulator) needs no tables."""
        bs = self.kv.blocks.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        dec_rows: list[int] = []
        dec_lens: list[int] = []
        dec_tables: list[list[int]] = []
        reps: list[int] | None = None  # rows of each of dec_tables, where a prefill's rows share one
        prefills = []
        sample_rows = []
        score_rows: list[int] = []
        for c in chunks:
            row = len(ids)
            seq, start, n = c.seq, c.start, c.n
            end = start + n
            if n == 1:
                table = seq.block_table
                slots.append(table[start // bs] * bs + start % bs)
                ids.append(seq.token_at(start))
                positions.append(start)
                dec_rows.append(row)
                dec_lens.append(end)
                dec_tables.append(table)
                if reps is not None:
                    reps.append(1)
            else:
                slots.extend(self.kv.slots(seq.block_table, start, end))
                ids.extend(seq.token_at(p) for p in range(start, end))
                positions.extend(range(start, end))
                if self.rowwise:  # each row as a decode token: its own length, its sequence's table
                    reps = reps or [1] * len(dec_tables)
                    reps.append(n)
                    dec_rows.extend(range(row, row + n))
                    dec_lens.extend(range(start + 1, end + 1))
                    dec_tables.append(seq.block_table)
                elif self.attends:
                    kv_slots = torch.tensor(self.kv.slots(seq.block_table, 0, end), dtype=torch.long)
                    prefills.append((row, n, kv_slots, self._mask(torch.arange(start, end), end)))
            if end == seq.num_tokens:  # (`Chunk.samples`)
                sample_rows.append(row + n - 1)
            if seq.prompt_logprobs >= 0:  # (`Sequence.scores`: none otherwise)
                score_rows.extend(row + p - start for p in seq.scores(start, n))
        t, bd, s = len(ids), len(dec_rows), len(sample_rows)
        flat = np.array(ids + positions + slots + dec_lens + dec_rows + sample_rows + score_rows, dtype=np.int64)
        tok, pos, slot, lens, drows, srows, rrows = torch.from_numpy(flat).split_with_sizes(
            [t, t, t, bd, bd, s, len(score_rows)])
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.cfg.torch_dtype) if self.attends else (pos, pos)
        tables = _padded(dec_tables) if self.attends else torch.empty(bd, 0, dtype=torch.long)  # [Bd, Tb]
        if reps is not None and self.attends:
            tables = tables.repeat_interleave(torch.tensor(reps), dim=0)
        dec_kv = dec_mask = None
        # Torch's path: every decode token's slots and mask, padded to the longest.
        if self.paged is None and self.attends:
            dec_kv, dec_mask = self._dense_decode(tables, lens)
        return StepMeta(tok, pos, cos, sin, slot, drows, tables, lens, dec_kv, dec_mask, prefills, bd == t, srows, rrows,
                        [(c.seq.request_id, c.start, c.n) for c in chunks])

    async def forward(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the step and returns float32 logits, each in chunk order.

        The first are for the chunks that sample [S, V], the second for the rows that score prompt
        tokens [R, V]."""
        t0 = time.perf_counter()
        trace.stamp("step", "", 0)
        c0 = cpu_regions.start()
        step = self.clock.run(self._first, chunks)
        cpu_regions.add("step: metadata, stand-ins or layers, first plan", c0)
        trace.stamp("begun", "", 0)  # (metadata, embeddings, the layers up to the first plan)
        while True:
            await self._pace(step)
            if step.plan is None:
                break
            t1 = time.perf_counter()
            parts = await self.refe.run_plan(step.plan)
            self.expert_wait_s += time.perf_counter() - t1
            c0 = cpu_regions.start()
            step = self.clock.run(self._resume, step, parts)
            cpu_regions.add("layer: combine, layers, next plan", c0)
        c0 = cpu_regions.start()
        if self.kv_sink is not None:  # the step's KV, every layer's, in the cache (checkpoints go at a step's end)
            self.kv_sink(step.meta.spans, step.meta.slots)
        cpu_regions.add("step: KV to the checkpointer", c0)
        self.forward_s += time.perf_counter() - t0
        trace.stamp("logits", "", 0)
        assert step.logits is not None and step.scored is not None
        return step.logits, step.scored

    async def _pace(self, step: StepState) -> None:
        """Runs after each compute call. A cost model waits here; this one does nothing."""

    def forward_local(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs a step whose experts add nothing: no EW, no event loop, no checkpoints.

        The warm-up uses it (attention_worker/warmup.py), and so do tests of the attention side alone."""
        step = self._begin(chunks)
        while step.plan is not None:
            step = self._resume(step, [])
        assert step.logits is not None and step.scored is not None
        return step.logits, step.scored

    def _first(self, chunks: list[Chunk]) -> StepState:
        if self.slow is not None:  # the test-only fault hook: a slow device
            self.slow()
        return self._begin(chunks)

    def _begin(self, chunks: list[Chunk]) -> StepState:
        """The step's metadata and embeddings, then the layers up to the first MoE layer's routing."""
        meta = self.prepare(chunks).to(self.kv.device)
        return self._advance(StepState(meta, self.w.embed[meta.ids]))  # h [T, D]

    def _resume(self, step: StepState, parts: list[Part]) -> StepState:
        """A MoE layer's expert results into the residual, then on to the next."""
        assert step.plan is not None
        step.h = self.glue.combine_add(step.h, step.plan, parts)
        step.layer, step.plan = step.plan.layer + 1, None
        return self._advance(step)

    def _advance(self, step: StepState) -> StepState:
        """Runs layers from `step.layer` until one needs its experts or the last is done.

        In the first case its rows are planned, in the second the logits are made. A pure decode step on a GPU
        replays the layers' CUDA graph where it has one (attention_worker/cuda_graphs.py)."""
        meta = step.meta
        ran = self.graphs.run(step) if self.graphs is not None else None
        i, step.h, routed = ran if ran is not None else self.run_layers(step.layer, step.h, meta)
        if routed is not None:
            x, weights, experts = routed
            step.layer, step.plan = i, self.glue.plan(i, x, experts, weights, self.cfg.num_experts)
            return step
        s = meta.sample_rows.numel()
        rows = torch.cat([meta.sample_rows, meta.score_rows]) if meta.score_rows.numel() else meta.sample_rows
        last = self.glue.norm(step.h[rows], self.w.norm)  # [S + R, D]
        logits = to_host(self.w.lm_head(last).float())  # [S + R, V] (sampled on the host)
        step.logits, step.scored = logits[:s], logits[s:]
        return step

    def run_layers(self, first: int, h: torch.Tensor, meta: StepMeta) -> tuple[int, torch.Tensor, Routed | None]:
        """The layers from `first` on, h [T, D], up to the next MoE layer's routing: (that layer, h, (its input x
        [T, D], weights [T, k], experts [T, k])), or (layers, h, None) past the last. Device ops only, no wait."""
        cfg, glue = self.cfg, self.glue
        for i in range(first, len(self.w.layers)):
            lw = self.w.layers[i]
            a = self._attention(i, lw, glue.norm(h, lw.input_norm), meta)
            h, x = glue.add_norm(h, a, lw.post_norm)  # h + attention, its norm [T, D]
            if lw.dense is not None:
                h = h + lw.dense(x)  # (on the experts' kernel where it has one: a row's floats alone)
                continue
            assert lw.router is not None
            weights, experts = glue.route(glue.router_logits(x, lw.router), cfg.top_k, cfg.norm_topk_prob)
            return i, h, (x, weights, experts)
        return len(self.w.layers), h, None

    def _decode(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        """The decode tokens' attention, q [Bd, H, d] over their sequences' KV in the cache -> [Bd, H, d]."""
        if self.paged is not None:
            return self.paged(q, kc, vc, meta.dec_tables, meta.dec_lens, self.kv.blocks.block_size, self.scale,
                              self.cfg.sliding_window or 0)
        assert meta.dec_kv is not None and meta.dec_mask is not None
        kd = _gather(kc, meta.dec_kv).transpose(1, 2)  # [Bd, K, L, d]
        vd = _gather(vc, meta.dec_kv).transpose(1, 2)
        od = F.scaled_dot_product_attention(q.contiguous().unsqueeze(2), kd, vd, attn_mask=meta.dec_mask,
                                            enable_gqa=True)  # [Bd, H, 1, d]
        return od.squeeze(2)

    def _attention(self, i: int, lw: LayerWeights, x: torch.Tensor, meta: StepMeta) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        qkv = lw.qkv(x)  # [T, (H + 2K) d]
        if lw.qkv_bias is not None:
            qkv = qkv + lw.qkv_bias
        kc, vc = self.kv.k[i], self.kv.v[i]  # [B*S, K, d]
        norms = (lw.q_norm, lw.k_norm) if lw.q_norm is not None and lw.k_norm is not None else None  # Qwen3's
        q, k, v = self.glue.rope_cache(qkv, meta.cos, meta.sin, kc, vc, meta.slots, cfg.num_heads, norms)
        if meta.all_decode:  # a pure decode step: no row to pick or put back
            return lw.o_proj(self._decode(q, kc, vc, meta).view(t, -1))
        out = torch.empty(t, cfg.num_heads, cfg.head_dim, dtype=qkv.dtype, device=qkv.device)  # [T, H, d]
        if meta.dec_rows.numel():
            out[meta.dec_rows] = self._decode(q[meta.dec_rows], kc, vc, meta)
        for row, n, kv_slots, mask in meta.prefills:
            qp = q[row : row + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
            kp = _gather(kc, kv_slots).transpose(0, 1).unsqueeze(0)  # [1, K, L, d]
            vp = _gather(vc, kv_slots).transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, enable_gqa=True)
            out[row : row + n] = op[0].transpose(0, 1)
        return lw.o_proj(out.reshape(t, -1))
