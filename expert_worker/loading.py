"""Where an expert worker's experts come from: the host's weight store, mapped, where it has them (a standby maps
every expert ahead), else their tensors read from the checkpoint. These block, so the worker runs them in a thread
(`fabric.process.run_niced_async`)."""

from __future__ import annotations

import logging
import time

from expert_worker.executor import ExpertExecutor
from expert_worker.sim_executor import SimExecutor
from fabric.config import ExpertWorkerConfig
from fabric.model.config import ModelConfig
from fabric.model.weight_store import MappedStore, open_store

log = logging.getLogger("expert_worker")


def open_weight_store(cfg: ExpertWorkerConfig, model: ModelConfig,
                      executor: ExpertExecutor | SimExecutor) -> MappedStore | None:
    """The host's weight store in the layout of the executor's kernel, on its device; None under `--compute sim`."""
    if cfg.compute == "sim":
        return None
    assert isinstance(executor, ExpertExecutor)
    executor.choose_kernel()
    return open_store(cfg.weight_store, cfg.model, model.torch_dtype, executor.gemm, cfg.weight_store_wait_s)


def premap_all(cfg: ExpertWorkerConfig, model: ModelConfig, executor: ExpertExecutor | SimExecutor) -> None:
    """A standby's mappings of every expert in the weight store, made ahead (page tables only)."""
    store = open_weight_store(cfg, model, executor)  # (the kernel chosen first: the store has its layout)
    if store is None:
        return
    t0 = time.perf_counter()
    executor.premap(store, [(lyr, e) for lyr in model.moe_layers for e in range(model.num_experts)])
    log.info("a standby: mapped all %d experts of the weight store ahead (%.1f MiB) in %.3fs",
             len(executor.premapped), store.bytes_mapped / 2**20, time.perf_counter() - t0)
    store.close()


def load(cfg: ExpertWorkerConfig, model: ModelConfig, executor: ExpertExecutor | SimExecutor,
         units: list[tuple[int, int]]) -> None:
    """Loads these experts: mapped ahead, from the weight store, or read from the checkpoint."""
    store = open_weight_store(cfg, model, executor) if any(u not in executor.premapped for u in units) else None
    try:
        executor.load(cfg.model, units, store)
    finally:
        if store is not None:
            store.close()
