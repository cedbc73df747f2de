"""The weight store, one long-lived process per host.

It reads the checkpoint once. It publishes every tensor the host's workers serve with, in its
serving layout, in host memory (fabric/model/weight_store.py). Workers started later map their
tensors from it in milliseconds instead of reading the checkpoint. This helps replacements and
woken standbys above all.

Its life:
1. Adopt a complete store of the same key already in `--dir`, one published by a store that died.
   Else read the checkpoint and publish.
2. Say READY.
3. Wait for SIGTERM.
4. Remove the store if `--remove-on-exit`.

It is not on any data path. A worker that mapped its tensors keeps them whether the store lives,
dies or publishes again.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from fabric.config import WeightStoreConfig
from fabric.kernels import skinny
from fabric.model.attention_weights import serving_tensors
from fabric.model.checkpoint import Checkpoint
from fabric.model.config import ModelConfig
from fabric.model.expert_weights import expert_names, prepare_expert
from fabric.model.weight_store import StoreKey, StoreMiss, publish, read_manifest, store_key
from fabric.notify import notifier
from fabric.process import run_niced_async

log = logging.getLogger("weight_store")


def keys(cfg: ModelConfig, model_dir: str, kernel: str) -> tuple[StoreKey, skinny.SkinnyGemm | None]:
    """Returns the store's key and the kernel its tensors (the AWs' and the experts') are packed for: the one the
    workers choose with `--kernel kernel`."""
    gemm = skinny.gemm_for(kernel, cfg.torch_dtype)
    return store_key(model_dir, cfg.torch_dtype, gemm), gemm


def all_tensors(model_dir: str, cfg: ModelConfig, gemm: skinny.SkinnyGemm | None) -> Iterator[tuple[str, torch.Tensor]]:
    ckpt = Checkpoint(model_dir, cfg.torch_dtype)
    yield from serving_tensors(ckpt, cfg, gemm)
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            yield from zip(expert_names(layer, e), prepare_expert(ckpt, cfg, gemm, layer, e), strict=True)


def build(cfg: WeightStoreConfig) -> str:
    """Adopts or publishes the store and returns what it did, for the log."""
    t0 = time.perf_counter()
    model = ModelConfig.from_dir(cfg.model, cfg.dtype)
    key, gemm = keys(model, cfg.model, cfg.kernel)
    directory = Path(cfg.dir)
    try:
        manifest = read_manifest(directory, key)
        return f"adopted the weight store in {directory} ({manifest['size'] / 2**20:.1f} MiB, {key.kernel} layout)"
    except StoreMiss as exc:
        log.info("publishing: %s", exc)
    manifest = publish(directory, key, all_tensors(cfg.model, model, gemm))
    return (f"published {len(manifest['tensors'])} tensors ({manifest['size'] / 2**20:.1f} MiB, {key.kernel} layout) "
            f"in {directory} in {time.perf_counter() - t0:.2f}s")


async def serve(cfg: WeightStoreConfig, stop: asyncio.Event) -> None:
    note = notifier()
    watchdog = asyncio.get_running_loop().create_task(note.watchdog())
    try:
        said = await run_niced_async(lambda: build(cfg), cfg.boot_nice)
        log.info("%s", said)
        note.send("READY=1")
        await stop.wait()
    finally:
        watchdog.cancel()
        note.send("STOPPING=1")
        if cfg.remove_on_exit:
            shutil.rmtree(cfg.dir, ignore_errors=True)
            log.info("removed the weight store in %s", cfg.dir)
