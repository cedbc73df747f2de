"""The simulated compute backend (`--compute sim`): a fabric on a checkpoint directory that holds
only a config.json runs everything but the tensor math; its outputs are deterministic, depend on
the experts that ran, and survive an EW's and an AW's death token for token."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from attention_worker.forwarding import ForwardingEngine
from attention_worker.glue import TorchGlue
from attention_worker.kv_cache import KVCache
from attention_worker.layer_plan import LayerPlan, Part
from attention_worker.model_runner import Chunk
from attention_worker.request import Sequence
from attention_worker.sim_runner import SimRunner
from expert_worker.gather import PendingCall
from expert_worker.sim_executor import SimExecutor, sim_factor
from fabric.config import OrchestratorConfig
from fabric.messages.expert import ExpertCall
from fabric.model.config import ModelConfig
from launch.experiments.sim_cluster import SimCluster
from launch.local import Fabric
from tests.conftest import running_fabric
from tests.helpers import iter_stream, wait_for
from tests.load import BODY, PROMPTS, TOKENS, kill_mid_decode, run_streams


def config_only(src: Path, dst: Path, **over: object) -> Path:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **over}))
    for f in src.iterdir():  # the tokenizer, if any; never the weights
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, dst / f.name)
    return dst


def test_a_sim_expert_worker_scales_each_row_by_its_experts_factor(hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(hf_models["mixtral"])
    ex = SimExecutor(cfg, expert_ms=0.0, expert_row_us=0.0)
    ex.load("", [(1, 2), (1, 5)])
    x = torch.randn(5, cfg.hidden_size)
    call = ExpertCall(call_id=1, layer=1, epoch=1, experts=[2, 5], counts=[2, 3], x=x)
    (y,) = ex.run([PendingCall("aw-0", None, call)])  # type: ignore[arg-type]
    assert torch.equal(y[:2], x[:2] * sim_factor(1, 2)) and torch.equal(y[2:], x[2:] * sim_factor(1, 5))
    assert sim_factor(1, 2) != sim_factor(1, 5) and ex.tokens_by_expert == {(1, 2): 2, (1, 5): 3}
    assert ex.experts.keys() == {(1, 2), (1, 5)} and ex.bytes_read == ex.bytes_mapped == 0
    bf16 = ExpertCall(call_id=2, layer=1, epoch=1, experts=[5, 2], counts=[1, 0], x=x[:1].bfloat16())
    (z,) = ex.run([PendingCall("aw-0", None, bf16)])  # type: ignore[arg-type]
    assert z.dtype == torch.bfloat16 and torch.equal(z, bf16.x * torch.tensor([sim_factor(1, 5)], dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sim_aws_stand_in_kv_lands_in_its_cache_at_the_steps_slots(hf_models: dict[str, Path], dtype: str) -> None:
    """The sim AW writes each layer's stand-in K and V into its caches at the step's slots, and nothing else; its
    checkpointer is handed the step's spans and those slots, and reads the K and V from there."""
    cfg = dataclasses.replace(ModelConfig.from_dir(hf_models["mixtral"]), dtype=dtype)
    kv = KVCache(cfg, 4, 1 << 20)
    runner = SimRunner(cfg, kv, cast(ForwardingEngine, NoExperts()), 0.0, glue=TorchGlue(cfg.rms_norm_eps))
    seen: list[tuple[list[tuple[str, int, int]], torch.Tensor]] = []
    runner.kv_sink = lambda spans, slots: seen.append((spans, slots.clone()))
    seqs = [Sequence(f"r{i}", p, [], 4, 0.0, 1.0, -1, 0, frozenset(), True) for i, p in enumerate([[5], [7, 8, 9]])]
    for _ in range(3):
        before = [t.clone() for t in kv.k + kv.v]
        seen.clear()
        chunks = [Chunk(q, q.num_computed, q.num_tokens - q.num_computed) for q in seqs]
        for c in chunks:
            assert kv.blocks.grow(c.seq.block_table, c.start + c.n)
        logits, _ = asyncio.run(runner.forward(chunks))
        slots = torch.tensor([s for c in chunks for s in kv.slots(c.seq.block_table, c.start, c.start + c.n)])
        (spans, handed), = seen
        assert spans == [(c.seq.request_id, c.start, c.n) for c in chunks] and torch.equal(handed, slots)
        stand_in = kv.k[0][slots]
        assert stand_in.abs().sum() > 0 and not torch.equal(stand_in, before[0][slots])
        for layer in range(cfg.num_layers):
            assert torch.equal(kv.k[layer][slots], stand_in) and torch.equal(kv.v[layer][slots], stand_in)
            for cache, old in ((kv.k[layer], before[layer]), (kv.v[layer], before[cfg.num_layers + layer])):
                untouched = torch.ones(cache.shape[0], dtype=torch.bool)
                untouched[slots] = False
                assert torch.equal(cache[untouched], old[untouched])
        for c, token in zip(chunks, logits.argmax(-1).tolist()):
            c.seq.num_computed += c.n
            c.seq.append(token)


def test_a_sim_aws_stand_ins_follow_their_formulas(hf_models: dict[str, Path]) -> None:
    """What the sim AW's docstring says of its stand-ins: h[t, j] = sin(0.01 (token + 1)(j mod 8 + 1) + 0.1 position), k
    distinct experts a row at every layer, and one-hot logits on the token picked from 8 of h's values."""
    cfg = ModelConfig.from_dir(hf_models["mixtral"])
    kv = KVCache(cfg, 4, 1 << 20)
    runner = SimRunner(cfg, kv, cast(ForwardingEngine, NoExperts()), 0.0, glue=TorchGlue(cfg.rms_norm_eps))
    seqs = [Sequence(f"r{i}", p, [], 4, 0.0, 1.0, -1, 0, frozenset(), True) for i, p in enumerate([[5], [7, 8, 9]])]
    chunks = [Chunk(q, 0, q.num_tokens) for q in seqs]
    for c in chunks:
        assert kv.blocks.grow(c.seq.block_table, c.n)
    step = runner._begin(chunks)
    token, pos = torch.tensor([5.0, 7, 8, 9], dtype=torch.float64), torch.tensor([0.0, 0, 1, 2], dtype=torch.float64)
    j = (torch.arange(cfg.hidden_size) % 8 + 1).to(torch.float64)  # 8 values a row, repeated
    h = torch.sin(0.01 * (token[:, None] + 1) * j[None, :] + 0.1 * pos[:, None])  # [T, D]
    assert torch.allclose(step.h.double(), h, atol=1e-5)
    assert len(step.experts) == cfg.num_layers and len({tuple(e.flatten().tolist()) for e in step.experts}) > 1
    for experts in step.experts:  # [T, k] a layer
        assert experts.shape == (4, cfg.top_k) and int(experts.min()) >= 0 and int(experts.max()) < cfg.num_experts
        assert all(len(set(row)) == cfg.top_k for row in experts.tolist())
    logits, _ = asyncio.run(runner.forward(chunks))  # experts that add nothing: h is the last layer's too
    last = step.h[[0, 3]].float()  # each chunk's last row samples
    want = torch.floor(last[:, :8] * 1000).long().sum(1).remainder(cfg.vocab_size)
    assert torch.equal(logits.argmax(-1), want) and torch.equal((logits != 0).sum(-1), torch.ones(2, dtype=torch.long))


class NoExperts:
    """A REFE whose experts add nothing."""

    async def run_plan(self, plan: LayerPlan) -> list[Part]:
        return [(slice(0, plan.xs.shape[0]), torch.zeros_like(plan.xs))]


def test_a_sim_fabric_survives_ew_and_aw_deaths_token_for_token(hf_models: dict[str, Path], tmp_path: Path) -> None:
    # Wider than the test checkpoint (so the wire carries more), and no weights at all.
    model = config_only(hf_models["mixtral"], tmp_path / "sim-model", hidden_size=512, num_hidden_layers=6)
    assert not list(model.glob("*.safetensors"))
    with running_fabric(model, tmp_path, aws=2, ews=3, compute="sim", sim_attention_ms=0.2,
                        sim_expert_ms=0.2) as fabric:
        reference = run_streams(fabric)
        cluster = wait_for(fabric, "the EWs' stats", lambda c: all(
            "kernel" in w["stats"] for w in c["workers"] if w["role"] == "expert"))
        ews = [w for w in cluster["workers"] if w["role"] == "expert"]
        assert all(w["stats"]["kernel"] == "sim" and w["stats"]["expert_mib_read"] == 0 for w in ews)
        assert sum(sum(w["stats"]["tokens_by_expert"].values()) for w in ews) > 0
        assert run_streams(fabric) == reference  # deterministic
        assert len({tuple(r) for r in reference}) > 1  # and not one stream for every prompt
        # Empty calls (the sync gather's padding) only while another AW has a batch running there.
        together = _ew_counts(fabric)
        alone = [t for ev in iter_stream(f"http://127.0.0.1:{fabric.port}/v1/completions",
                                         {**BODY, "prompt": PROMPTS[0]}) for t in ev["choices"][0]["token_ids"]]
        assert alone == reference[0]
        after = _ew_counts(fabric)
        assert sum(n for _, n in together.values()) > 0  # 8 streams over both AWs: padded
        # One stream: its AW stops after each EW's first result. Padding every layer, it would send at least
        # one a layer a token (3 EWs, each token's rows on at most 2 of them).
        assert sum(after[w][1] - together[w][1] for w in after) < TOKENS
        assert sum(after[w][0] - together[w][0] for w in after) > 0
        _, outputs, _ = kill_mid_decode(fabric, "expert-worker-1", signal.SIGINT, reference=reference)
        assert outputs == reference
        _, outputs, _ = kill_mid_decode(fabric, "attention-worker-0", signal.SIGINT, reference=reference)
        assert outputs == reference


def _ew_counts(fabric: Fabric) -> dict[str, tuple[int, int]]:
    """Each EW's (batches, empty calls) once its stats stop changing (they are reported every second)."""
    deadline, last = time.monotonic() + 60, None
    while True:
        c = fabric.cluster()
        now = {w["id"]: (w["stats"]["batches"], w["stats"]["empty_calls"]) for w in c["workers"]
               if w["role"] == "expert" and "empty_calls" in w.get("stats", {})}
        if now and now == last:
            return now
        assert time.monotonic() < deadline, f"the EWs' stats kept changing: {now}"
        last = now
        time.sleep(2.5)


def _killing(cl: SimCluster, fabric: Fabric, kill: Callable[[], object]) -> list[list[int]]:
    """The streams again, `kill` called once they decode; returns their tokens."""
    received, started, out = [0], threading.Event(), []
    runner = threading.Thread(target=lambda: out.append(run_streams(fabric, received, started)))
    runner.start()
    assert started.wait(60)
    kill()
    runner.join(180)
    assert out and received[0] > 0
    return out[0]


def test_many_simulated_workers_per_process_fail_over_token_for_token(hf_models: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    """3 AWs in one process, 4 EWs in another (`--sim-workers`): each registers and links as a
    worker of its own; killing one of them (its sockets cut, as on SIGKILL) leaves its process-mates
    serving, the streams identical; a restarted orchestrator gets every worker back."""
    model = config_only(hf_models["mixtral"], tmp_path / "sim-model", hidden_size=256, num_hidden_layers=4)
    with SimCluster(model, aws=3, ews=4, per_process=4, log_dir=tmp_path / "logs", attention_ms=0.2,
                    expert_ms=0.2, probe_interval_ms=10.0, lease_ms=700.0) as cl:  # (the defaults, not the sim's)
        cl.start()
        cl.wait_ready(120)
        fabric = cast(Fabric, SimpleNamespace(port=cl.gateway_port))
        c = cl.cluster()
        workers = [w for w in c["workers"] if w["role"] in ("attention", "expert")]
        assert len(workers) == 7 and len({w["pid"] for w in workers}) == 2  # seven workers, two processes
        assert len({w["port"] for w in workers}) == 7  # each listening on its own port
        reference = run_streams(fabric)
        assert len({tuple(r) for r in reference}) > 1

        ew = next(w for w in workers if w["role"] == "expert")
        died: list[float] = []
        assert _killing(cl, fabric, lambda: died.append(cl.kill_worker(ew["id"], ew["pid"]))) == reference
        c = wait_for(cl, "every AW's stats to name the dead EW", lambda c: all(
            ew["id"] in w["stats"].get("suspected_at", {}) for w in c["workers"]
            if w["role"] == "attention" and w["state"] == "alive"))
        mates = [w for w in c["workers"] if w["pid"] == ew["pid"] and w["id"] != ew["id"]]
        assert len(mates) == 3 and all(w["state"] == "alive" for w in mates)  # its process-mates serve on
        death = next(b for b in c["control"]["broadcasts"] if b["at"] >= died[0])
        whole = c["control"]["broadcasts"][-1]["whole_bytes"]  # (the size of the newest view, whole)
        assert death["deltas"] > 0 and 0 < death["delta_bytes"] < whole

        aw = next(w for w in c["workers"] if w["role"] == "attention" and w["state"] == "alive")
        assert _killing(cl, fabric, lambda: cl.kill_worker(aw["id"], aw["pid"])) == reference

        cl.kill_orchestrator()
        cl.start_orchestrator(recovery_grace_s=OrchestratorConfig.recovery_grace_s)  # (the default, as serve's)
        c = wait_for(cl, "the new orchestrator's recovery", lambda c: bool(c.get("recovery")))
        assert c["recovery"]["all_back"]
        assert run_streams(fabric) == reference
