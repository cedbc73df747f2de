"""An AW's bookkeeping of restores from the checkpoint store: a dead AW's requests are fetched
side by side, and one aborted while its KV is on the way (before or after its first chunk) leaves
nothing behind, nor does a store lost part-way. The store's side is a gate here (the integration
tests in test_checkpoint.py restore through a real store)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, cast

import torch

from attention_worker.checkpointer import Checkpointer
from attention_worker.engine import AttentionWorker
from attention_worker.forwarding import ForwardingEngine
from attention_worker.kv_cache import KVCache
from attention_worker.model_runner import ModelRunner
from fabric.config import AttentionWorkerConfig
from fabric.errors import PeerDeadError
from fabric.messages.base import Message
from fabric.messages.checkpoint import KvRestore
from fabric.messages.client import Submit
from fabric.model.config import ModelConfig


class GatedCheckpointer(Checkpointer):
    """The real checkpointer, with the store's side replaced: `fetch` waits at `gate`, then yields
    the KV in chunks of `CHUNK` tokens, waiting at `mid` after the first (or failing there, with
    `fail_mid`); `finished` is recorded."""

    CHUNK = 2

    def __init__(self, model: ModelConfig, kv: KVCache) -> None:
        super().__init__("aw-0", model, kv, None, None)  # type: ignore[arg-type]  # no links here
        self.gate = asyncio.Event()
        self.mid = asyncio.Event()
        self.mid.set()
        self.fail_mid = False
        self.at_mid = asyncio.Event()
        self.in_flight = 0
        self.most_in_flight = 0
        self.all_waiting = asyncio.Event()  # set once `expect` fetches wait at the gate together
        self.expect = 3
        self.done: list[str] = []

    async def fetch(self, owner: str, request_id: str, max_tokens: int) -> AsyncGenerator[KvRestore, None]:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        if self.in_flight == self.expect:
            self.all_waiting.set()
        try:
            await self.gate.wait()
        finally:
            self.in_flight -= 1
        cfg = self.cfg
        k = torch.randn(cfg.num_layers, max_tokens, cfg.num_kv_heads, cfg.head_dim, dtype=cfg.torch_dtype)
        for start in range(0, max_tokens, self.CHUNK):
            if start:
                self.at_mid.set()
                await self.mid.wait()
                if self.fail_mid:
                    raise PeerDeadError("checkpoint store")
            c = slice(start, start + self.CHUNK)
            yield KvRestore(1, max_tokens, start, k[:, c], -k[:, c])

    def finished(self, request_ids: list[str], hand_off: bool = False) -> None:
        self.done += request_ids


class Client:
    def __init__(self) -> None:
        self.sent: list[Message] = []

    async def send(self, msg: Message) -> None:
        self.sent.append(msg)

    def send_nowait(self, msg: Message) -> None:
        self.sent.append(msg)


def make_aw(model: Path, **cfg: Any) -> tuple[AttentionWorker, GatedCheckpointer]:
    """An engine with the gated checkpointer and neither EW links nor a model runner (no step runs)."""
    config = AttentionWorkerConfig(model=str(model), orchestrator="127.0.0.1:1", kv_cache_mib=4, **cfg)
    mc = ModelConfig.from_dir(model)
    kv = KVCache(mc, config.block_size, config.kv_cache_mib << 20, torch.device("cpu"))
    ckpt = GatedCheckpointer(mc, kv)
    return AttentionWorker(config, mc, kv, cast(ForwardingEngine, None), ckpt, cast(ModelRunner, None)), ckpt


def submit(rid: str) -> Submit:
    return Submit(request_id=rid, prompt_ids=[5, 6, 7, 8], max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_token_ids=[], ignore_eos=True, output_ids=[9, 10], restore_from="aw-1")


async def _scenario(model: Path) -> dict[str, Any]:
    aw, ckpt = make_aw(model)
    client = Client()
    free = aw.kv.blocks.num_free
    for rid in ("a", "b", "c"):  # each returns at once (restores waiting in line would time out here)
        aw._submit(submit(rid), client)  # type: ignore[arg-type]
    tasks = {rid: task for rid, (task, _) in aw.restoring.items()}
    await asyncio.wait_for(ckpt.all_waiting.wait(), 5)  # every fetch is at the store at once
    out: dict[str, Any] = {"most_in_flight": ckpt.most_in_flight, "restoring": sorted(tasks)}
    aw._remove("b")  # aborted mid-fetch
    ckpt.gate.set()
    await asyncio.wait_for(asyncio.gather(*tasks.values(), return_exceptions=True), 5)
    out.update(b_cancelled=tasks["b"].cancelled(), restoring_after=sorted(aw.restoring), scheduled=sorted(aw.scheduler.by_id), done=ckpt.done,
               computed={rid: s.num_computed for rid, s in aw.scheduler.by_id.items()}, sent=client.sent,
               blocks_used=free - aw.kv.blocks.num_free, blocks_of_two=2 * len(aw.scheduler.by_id["a"].block_table))
    return out


def test_restores_run_side_by_side_and_an_abort_mid_fetch_leaves_nothing(hf_models: dict[str, Path]) -> None:
    out = asyncio.run(_scenario(hf_models["mixtral"]))
    assert out["most_in_flight"] == 3 and out["restoring"] == ["a", "b", "c"]  # all three fetches at once
    assert out["b_cancelled"] and out["restoring_after"] == [] and out["scheduled"] == ["a", "c"]
    assert out["done"] == ["b"]  # the store is told to free the aborted request's checkpoint
    assert out["computed"] == {"a": 5, "c": 5}  # 6 tokens known, all but the last restored
    assert out["blocks_used"] == out["blocks_of_two"]  # nothing allocated for "b"
    assert out["sent"] == []  # no error for anyone


async def _join(model: Path, join_ms: float, open_gate: bool) -> dict[str, Any]:
    aw, ckpt = make_aw(model, restore_join_ms=join_ms)
    ckpt.expect = 1
    aw._submit(submit("a"), Client())  # type: ignore[arg-type]
    await asyncio.wait_for(ckpt.all_waiting.wait(), 5)
    join = asyncio.create_task(aw._join_restores())  # a step boundary with a restore under way
    for _ in range(20):
        await asyncio.sleep(0)
    waited = not join.done()
    if open_gate:
        ckpt.gate.set()
    await asyncio.wait_for(join, 5)
    out = {"waited": waited, "scheduled": sorted(aw.scheduler.by_id), "restoring": sorted(aw.restoring)}
    for task, _ in aw.restoring.values():
        task.cancel()
    return out


def test_a_step_waits_a_bounded_while_for_restores_under_way(hf_models: dict[str, Path]) -> None:
    # The restore lands while the step waits: it is scheduled before the step runs.
    out = asyncio.run(_join(hf_models["mixtral"], 10_000, open_gate=True))
    assert out == {"waited": True, "scheduled": ["a"], "restoring": []}
    # The store does not answer: the step goes on without it once the bound has passed.
    out = asyncio.run(_join(hf_models["mixtral"], 500, open_gate=False))  # (well past 20 loop turns)
    assert out == {"waited": True, "scheduled": [], "restoring": ["a"]}


async def _mid_stream(model: Path, fail: bool) -> dict[str, Any]:
    """One restore stopped after its first chunk is in the cache: aborted, or the store lost."""
    aw, ckpt = make_aw(model)
    ckpt.expect, ckpt.fail_mid = 1, fail
    ckpt.gate.set()
    ckpt.mid.clear()
    client = Client()
    free = aw.kv.blocks.num_free
    aw._submit(submit("a"), client)  # type: ignore[arg-type]
    task = aw.restoring["a"][0]
    await asyncio.wait_for(ckpt.at_mid.wait(), 5)
    out: dict[str, Any] = {"blocks_mid": free - aw.kv.blocks.num_free}
    if not fail:
        aw._remove("a")
    ckpt.mid.set()
    await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
    seqs = aw.scheduler.by_id
    out.update(cancelled=task.cancelled(), done=ckpt.done, sent=client.sent, scheduled=sorted(seqs),
               computed={rid: s.num_computed for rid, s in seqs.items()}, restores=ckpt.restores,
               blocks_after=free - aw.kv.blocks.num_free)
    return out


def test_a_restore_stopped_part_way_leaves_no_blocks(hf_models: dict[str, Path]) -> None:
    out = asyncio.run(_mid_stream(hf_models["mixtral"], fail=False))  # the client went away
    assert out["blocks_mid"] > 0  # the premise: the first chunk was written into allocated blocks
    assert out["cancelled"] and out["done"] == ["a"] and out["scheduled"] == [] and out["blocks_after"] == 0
    out = asyncio.run(_mid_stream(hf_models["mixtral"], fail=True))  # the store died mid-stream
    assert out["blocks_mid"] > 0 and not out["cancelled"] and out["restores"] == 0
    assert out["scheduled"] == ["a"] and out["computed"] == {"a": 0}  # it replays: prompt and outputs re-prefilled
    assert out["blocks_after"] == 0 and out["sent"] == []  # no blocks held before its prefill is scheduled
