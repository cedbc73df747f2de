"""The host-memory weight store: what a worker maps from it equals what it reads from the
checkpoint (values and layout), a store of another key is refused, a store that publishes again
leaves mapped tensors intact; and in a running fabric, a dead EW's and a dead AW's places are taken
by warm standbys that map their weights (no checkpoint byte read, on their own counters) while
every stream stays token-identical."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from expert_worker.executor import ExpertExecutor
from fabric.config import WeightStoreConfig
from fabric.kernels import skinny
from fabric.model.attention_weights import AttentionWeights, serving_tensors
from fabric.model.checkpoint import Checkpoint
from fabric.model.config import ModelConfig
from fabric.model.store_dir import default_dir
from fabric.model.weight_store import (
    MappedStore,
    StoreKey,
    StoreMiss,
    fingerprint,
    publish,
    read_manifest,
)
from tests.conftest import running_fabric
from tests.helpers import replacement_of, wait_for, worker_by_pid
from tests.load import kill_mid_decode, run_streams, wait_gone
from weight_store.main import build, keys


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("kernel", ["torch", "auto"])
def test_mapped_weights_equal_the_checkpoints(hf_models: dict[str, Path], tmp_path: Path, arch: str, kernel: str) -> None:
    model = str(hf_models[arch])
    cfg = ModelConfig.from_dir(model)
    said = build(WeightStoreConfig(model=model, dir=str(tmp_path / "ws"), kernel=kernel))
    assert said.startswith("published")
    key, aw_gemm = keys(cfg, model, kernel)
    store = MappedStore(tmp_path / "ws", key)
    read = AttentionWeights.load(model, cfg, aw_gemm)
    mapped = AttentionWeights.build(lambda n: store.get(n) if store.has(n) else None, cfg, aw_gemm)
    assert read.bytes_read > 0 and mapped.bytes_read == 0
    names = [n for n, _ in serving_tensors(Checkpoint(model, cfg.torch_dtype), cfg, aw_gemm)]
    assert all(store.has(n) for n in names)
    for a, b in [(read.embed, mapped.embed), (read.norm, mapped.norm), (read.lm_head.w, mapped.lm_head.w)]:
        assert torch.equal(a, b) and a.stride() == b.stride()  # the same layout: the same matmul numerics
    for la, lb in zip(read.layers, mapped.layers):
        assert torch.equal(la.qkv.w, lb.qkv.w) and la.qkv.w.stride() == lb.qkv.w.stride()
        assert (la.qkv.gemm is None) == (lb.qkv.gemm is None)
        assert torch.equal(la.o_proj.w, lb.o_proj.w)
        assert (la.router is None) == (lb.router is None)
        if la.router is not None:
            assert lb.router is not None and torch.equal(la.router, lb.router)

    # An EW: the same experts, no checkpoint byte read when mapped.
    units = [(layer, e) for layer in cfg.moe_layers[:2] for e in (0, cfg.num_experts - 1)]
    a, b = ExpertExecutor(cfg, kernel), ExpertExecutor(cfg, kernel)
    a.load(model, units)
    b.load(model, units, store)
    assert a.bytes_read > 0 and a.bytes_mapped == 0
    assert b.bytes_read == 0 and b.bytes_mapped > 0
    for u in units:
        assert all(torch.equal(x, y) for x, y in zip(a.experts[u], b.experts[u]))

    # Another layout or dtype: refused (the worker reads the checkpoint instead).
    other = StoreKey(key.fingerprint, key.dtype, "torch" if key.kernel == "skinny" else "skinny")
    with pytest.raises(StoreMiss, match="needs"):
        MappedStore(tmp_path / "ws", other)


def test_store_adopts_republishes_and_mapped_tensors_survive(hf_models: dict[str, Path], tmp_path: Path) -> None:
    model = str(hf_models["mixtral"])
    cfg = ModelConfig.from_dir(model)
    ws = tmp_path / "ws"
    with pytest.raises(StoreMiss, match="no weight store"):
        MappedStore.wait(ws, keys(cfg, model, "torch")[0], timeout=0.1)
    build(WeightStoreConfig(model=model, dir=str(ws), kernel="torch"))
    assert build(WeightStoreConfig(model=model, dir=str(ws), kernel="torch")).startswith("adopted")  # a restarted store
    key = keys(cfg, model, "torch")[0]
    first = read_manifest(ws, key)["data"]
    store = MappedStore(ws, key)
    embed = store.get("embed")
    expected = embed.clone()
    # Another layout is published over it (a store of another kernel): the old data file is
    # unlinked, and what was mapped from it stays valid.
    if skinny.gemm_for("auto", torch.float32) is not None:
        build(WeightStoreConfig(model=model, dir=str(ws), kernel="auto"))
        assert not (ws / first).exists()
        assert torch.equal(embed, expected)
    # The checkpoint changed: the fingerprint does too, and the old store is not used.
    (Path(model) / "config.json").touch()
    assert fingerprint(model) != key.fingerprint


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists() or not Path("/dev/shm").is_dir(),
                    reason="Linux memory accounting and /dev/shm")
def test_mapping_shares_the_stores_pages_and_holds_one_file() -> None:
    """What a worker maps is the store's memory (shared), not a private copy, and a worker holds
    one file descriptor for any number of tensors."""
    ws = default_dir(f"test-{os.getpid()}")
    try:
        key = StoreKey("f", "torch.float32", "torch")
        publish(ws, key, [(f"t{i}", torch.full((256, 1024), float(i))) for i in range(64)])  # 64 MiB
        fds, anon, shmem = len(os.listdir("/proc/self/fd")), _status_kib("RssAnon"), _status_kib("RssShmem")
        store = MappedStore(ws, key)
        tensors = [store.get(f"t{i}") for i in range(64)]
        store.close()
        assert len(os.listdir("/proc/self/fd")) <= fds + 1
        assert _status_kib("RssShmem") - shmem >= 48 * 1024  # faulted in up front, from the store
        assert _status_kib("RssAnon") - anon < 8 * 1024  # and not copied
        assert all(float(t[0, 0]) == i and float(t.sum()) == i * 256 * 1024 for i, t in enumerate(tensors))
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def serving(cluster: dict[str, Any]) -> list[dict[str, Any]]:
    return [w for w in cluster["workers"] if w["role"] in ("attention", "expert") and w["state"] == "alive"]


def weights(w: dict[str, Any]) -> tuple[float | None, float | None]:
    """A worker's (MiB read from the checkpoint, MiB mapped from the weight store), from its stats."""
    prefix = "expert_mib" if w["role"] == "expert" else "weights_mib"
    return w["stats"].get(f"{prefix}_read"), w["stats"].get(f"{prefix}_mapped")


def test_standbys_take_a_dead_ew_and_aw_place_mapping_from_the_store(hf_models: dict[str, Path], tmp_path: Path) -> None:
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=2, standby_workers=1) as fabric:
        def standbys_of(c: dict[str, Any]) -> list[dict[str, Any]]:
            return [w for w in c["workers"] if w["info"].get("standby")]

        # `serve` is ready once the serving workers are; the standbys may register a moment later.
        cluster = wait_for(fabric, "both standbys registered",
                           lambda c: sorted(w["role"] for w in standbys_of(c)) == ["attention", "expert"])
        standbys = standbys_of(cluster)
        assert all(w["state"] == "starting" for w in standbys)
        assert len(serving(cluster)) == 4
        # The first workers mapped theirs too: the store read the checkpoint, once.
        cluster = wait_for(fabric, "the workers' stats", lambda c: all(weights(w)[1] is not None for w in serving(c)))
        assert all(weights(w)[0] == 0 and weights(w)[1] > 0 for w in serving(cluster))

        # An EW dies under load: the standby EW takes its slot at once.
        reference, outputs, pid = kill_mid_decode(fabric, "expert-worker-1", signal.SIGINT)
        assert outputs == reference
        dead = worker_by_pid(fabric.cluster(), pid)
        cluster = wait_for(fabric, "the standby EW in the dead one's slot", lambda c: (
            (r := replacement_of(c, dead["id"])) is not None and r["stats"].get("expert_mib_mapped", 0) > 0))
        new = replacement_of(cluster, dead["id"])
        assert new is not None and new["id"] == next(w["id"] for w in standbys if w["role"] == "expert")
        assert new["stats"]["expert_mib_read"] == 0 and sorted(new["experts"]) == sorted(dead["experts"])
        # ... and a new standby boots behind it.
        wait_for(fabric, "a new standby EW", lambda c: any(
            w["role"] == "expert" and w["info"].get("standby") and w["state"] == "starting" for w in c["workers"]))

        # An AW dies under load: its streams resume elsewhere; the standby AW maps and serves.
        reference, outputs, pid = kill_mid_decode(fabric, "attention-worker-0", signal.SIGINT, reference=reference)
        assert outputs == reference
        dead = worker_by_pid(fabric.cluster(), pid)
        cluster = wait_for(fabric, "the standby AW serving", lambda c: replacement_of(c, dead["id"]) is not None)
        new = replacement_of(cluster, dead["id"])
        assert new is not None and new["id"] == next(w["id"] for w in standbys if w["role"] == "attention")
        cluster = wait_for(fabric, "its stats", lambda c: next(
            w for w in c["workers"] if w["id"] == new["id"])["stats"].get("weights_mib_mapped", 0) > 0)
        st = next(w for w in cluster["workers"] if w["id"] == new["id"])["stats"]
        assert st["weights_mib_read"] == 0
        wait_for(fabric, "a new standby AW", lambda c: any(
            w["role"] == "attention" and w["info"].get("standby") and w["state"] == "starting" for w in c["workers"]))
        assert sum(w["role"] == "attention" and w["state"] == "alive" for w in fabric.cluster()["workers"]) == 2
        assert run_streams(fabric) == reference  # the fabric with both woken standbys serves the same tokens
        ws = fabric.supervisor.configs.weight_store
        assert ws is not None
        store_dir = Path(ws.dir)
        assert (store_dir / "manifest.json").exists()
        pids = {w["pid"] for w in fabric.cluster()["workers"]} | {p.pid for _, p in fabric.procs}
    for p in pids:
        wait_gone(p, 15)
    assert not store_dir.exists()  # a serve run's store goes with it
