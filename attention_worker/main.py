"""Attention worker process: the engine (attention_worker/engine.py) plugged into the role runtime.

Start-up loads the attention weights in a niced thread, mapped from the host's weight store or read
from the checkpoint. Then the worker listens for gateways and registers. The first registration
gives the worker its id, which its expert links and checkpoints carry. The first routing table
connects it to every EW, and then its main loop starts.

A standby (`--standby`) does all of that, weights included. They are mapped from the weight store:
the worker holds page tables, and the pages are the store's. But it serves nothing until the
orchestrator wakes it to take a dead AW's place.

Later tables take effect between steps. None of this waits for the orchestrator once serving. The
REFE reroutes to shadows on its own, and checkpoints go on to the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import torch

from attention_worker.checkpointer import Checkpointer
from attention_worker.cuda_graphs import LayerGraphs, graphs_for
from attention_worker.engine import AttentionWorker
from attention_worker.forwarding import ForwardingEngine
from attention_worker.glue import TorchGlue, glue_for
from attention_worker.kv_cache import KVCache
from attention_worker.model_runner import ModelRunner
from attention_worker.sim_runner import SimRunner
from attention_worker.warmup import warm_up
from fabric import device, faults
from fabric.config import AttentionWorkerConfig
from fabric.errors import PeerDeadError
from fabric.kernels import choose, skinny
from fabric.kernels.choose import DecodeAttention
from fabric.messages.base import Message
from fabric.messages.control import (
    ClusterView,
    Life,
    Origin,
    PeerAlive,
    Role,
    RoutingUpdate,
    Traits,
    Wake,
    WorkerReady,
    WorkerStats,
)
from fabric.model.attention_weights import AttentionWeights
from fabric.model.config import ModelConfig
from fabric.model.weight_store import open_store
from fabric.process import run_niced_async
from fabric.runtime import Runtime, Service
from fabric.sim_host import serve_workers
from fabric.steps import StepClock
from fabric.transport import make_transport
from fabric.transport.base import Connection, Listener, Transport

log = logging.getLogger("attention_worker")


class AttentionService(Service):
    role = Role.ATTENTION

    def __init__(self, cfg: AttentionWorkerConfig) -> None:
        self.cfg = cfg
        self.model = ModelConfig.from_dir(cfg.model, cfg.dtype)
        self.transport = make_transport(cfg.transport, send_timeout=cfg.send_timeout_ms / 1000,
                                        secret=cfg.secret, tls=cfg.tls)
        self.control_transport: Transport | None = None  # to the EWs' control ports (`registered`)
        # The KV cache is sized now, as registration reports it. The engine that serves from it is
        # built once, when the worker has its id (`registered`).
        self.kv = KVCache(self.model, cfg.block_size, cfg.kv_cache_mib << 20, device.resolve(cfg.device))
        self.aw: AttentionWorker | None = None
        self.clock = StepClock()
        self.warmup_s: float | None = None
        self.weights: AttentionWeights | None = None
        self.attention: DecodeAttention | None = None  # chosen with the weights
        self.rowwise = False  # whether a prefill's rows take `attention` too (`choose.prefills_rowwise`)
        self.glue: TorchGlue | None = None  # likewise
        self.second_core: skinny.SkinnyGemm | None = None  # the GEMM, where its products share a helper thread
        # CUDA graphs of decode steps (on a GPU): the warm-up's runner captures the first, the serving runner's
        # replays them (the same weights, cache and kernels).
        self.graphs: LayerGraphs | None = None
        self.listener: Listener | None = None
        self.runtime: Runtime | None = None
        self.linked = False  # connected to the EWs of a first table
        self.serving = False
        self.awake = not cfg.standby  # a standby serves only once woken
        self.woken_for = ""  # a standby: the dead worker it was woken to replace
        # The pause before using again a store the orchestrator vouched for.
        self.store_rejoin_s = 0.0

    async def start(self, runtime: Runtime) -> int:
        self.runtime = runtime
        torch.set_num_threads(self.cfg.threads)
        if self.cfg.compute != "sim":  # a sim AW has no weights, and nothing cold
            await self._load_weights()  # a standby too: when woken it only starts serving
            gemm = choose.gemm(self.cfg.kernel, self.kv.device, self.model.torch_dtype)  # (the weights' own)
            if skinny.second_core(gemm):
                self.second_core = gemm
                log.info("few-row products share their blocks with a second CPU's thread")
            await self._warm_up()
        else:  # but the per-layer glue of real serving (the plan, the combine): it is the fabric's own work
            self.glue = await run_niced_async(self._glue, self.cfg.boot_nice)
        self.listener = await self.transport.listen(self.cfg.host, self.cfg.port, self._client)
        log.info("attention worker listening on %s:%d (%s, %d KV blocks%s)", self.cfg.host, self.listener.port,
                 self.transport.name, self.kv.blocks.num_blocks, ", a standby" if self.cfg.standby else "")
        return self.listener.port

    async def _client(self, conn: Connection) -> None:
        """Serves a gateway's connection.

        Gateways find this worker in the view only once it serves. A peer that connects before it has
        an engine is not one of them."""
        if self.aw is None:
            await conn.close()
            return
        await self.aw.handle_client(conn)

    async def _load_weights(self) -> None:
        """Maps the weights from the host's weight store where it has them, else reads the checkpoint.

        This runs off the loop. The kernel may be built on first use, and a store may still be
        publishing."""
        t0 = time.perf_counter()
        dtype, where = self.model.torch_dtype, self.kv.device

        def load() -> AttentionWeights:
            # It may build the CPU's kernels.
            self.attention = choose.decode_attention(self.cfg.kernel, where, dtype, self.cfg.block_size,
                                                     self.model.head_dim, graphs=self.cfg.cuda_graphs > 0)
            self.rowwise = choose.prefills_rowwise(self.cfg.kernel, where)  # (with none chosen, SDPA: `ModelRunner`)
            self.glue = self._glue()
            gemm = choose.gemm(self.cfg.kernel, where, dtype)
            store = open_store(self.cfg.weight_store, self.cfg.model, dtype, gemm, self.cfg.weight_store_wait_s)
            if store is None:
                return AttentionWeights.load(self.cfg.model, self.model, gemm, where)
            try:
                w = AttentionWeights.build(lambda n: store.get(n) if store.has(n) else None, self.model, gemm,
                                           device=where)
                w.bytes_mapped = store.bytes_mapped
                return w
            finally:
                store.close()

        self.weights = await run_niced_async(load, self.cfg.boot_nice)
        w = self.weights
        log.info("%s attention weights (%.1f MiB) in %.3fs", "mapped" if w.bytes_mapped else "read",
                 (w.bytes_read + w.bytes_mapped) / 2**20, time.perf_counter() - t0)

    def _glue(self) -> TorchGlue:
        """The per-layer glue (attention_worker/glue.py); it may build the CPU's kernels."""
        dtype, where = self.model.torch_dtype, self.kv.device
        return glue_for(choose.layer_ops(self.cfg.kernel, where, dtype), self.model.rms_norm_eps, dtype, where)

    async def _warm_up(self) -> None:
        """Runs the cold paths before this worker registers (attention_worker/warmup.py)."""
        assert self.weights is not None
        t0 = time.perf_counter()
        runner = ModelRunner(self.model, self.weights, self.kv, None, self.attention,  # type: ignore[arg-type]
                             glue=self.glue, rowwise=self.rowwise)
        runner.graphs = self.graphs = graphs_for(runner, self.cfg.cuda_graphs)
        steps = self.clock.run(warm_up, runner)
        self.warmup_s = time.perf_counter() - t0
        graphs = (f", {len(self.graphs.graphs)} CUDA graphs captured in {self.graphs.capture_s * 1e3:.0f} ms"
                  if self.graphs is not None else "")
        log.info("warm-up: %d steps in %.0f ms%s", steps, self.warmup_s * 1e3, graphs)

    def busy_for(self) -> float:
        return self.clock.running_for()

    def registration(self) -> dict[str, Any]:
        life = Life(Origin.REPLACEMENT, self.woken_for) if self.woken_for else Life(standby=not self.awake)
        warmup_ms = round(self.warmup_s * 1e3, 1) if self.warmup_s is not None else 0.0
        return {"ready": self.serving, "life": life,
                "traits": Traits(transport=self.transport.name, kv_blocks=self.kv.blocks.num_blocks,
                                 block_size=self.cfg.block_size, warmup_ms=warmup_ms)}

    async def registered(self) -> None:
        """Builds the engine once the first registration names this worker.

        Its expert links and checkpoints carry the id."""
        rt, cfg, kv = self.runtime, self.cfg, self.kv
        assert rt is not None
        if self.aw is not None:
            return
        self.control_transport = rt.tcp_transport()  # to the EWs' control ports, from this loop
        refe = ForwardingEngine(rt.worker_id, self.transport, self.control_transport, cfg.probe_interval_ms / 1000,
                                cfg.probe_misses, cfg.expert_wait_s, rt.report_dead, kv.device,
                                None if cfg.collapse_below_us is None else cfg.collapse_below_us / 1e6,
                                collapse_onto_one=cfg.collapse_onto == "one")
        ckpt = Checkpointer(rt.worker_id, self.model, kv, refe, self.transport, cfg.checkpoint,
                            cfg.checkpoint_pause_every, cfg.checkpoint_steps_per_message, on_lost=rt.report_dead)
        runner: ModelRunner
        if cfg.compute == "sim":
            runner = SimRunner(self.model, kv, refe, cfg.sim_attention_ms, self.clock, blocking=cfg.sim_workers == 1,
                               glue=self.glue)
        else:
            assert self.weights is not None  # loaded in `start`
            runner = ModelRunner(self.model, self.weights, kv, refe, self.attention, self.clock, faults.slow_steps(),
                                 self.glue, self.rowwise)
            runner.graphs = self.graphs
        runner.kv_sink = ckpt.record_step
        self.aw = AttentionWorker(cfg, self.model, kv, refe, ckpt, runner)

    async def handle(self, msg: Message) -> None:
        rt, aw = self.runtime, self.aw
        assert rt is not None and aw is not None  # messages come after the first registration
        refe = aw.refe
        if isinstance(msg, PeerAlive):
            refe.links.retry(msg.worker_id)  # this AW's own probes decide whether it is used again
            rt.cleared(msg.worker_id)
            aw.work.set()
            ckpt = aw.ckpt
            if msg.worker_id == ckpt.store_id and not ckpt.active:
                rt.spawn(self._rejoin_store())
        elif isinstance(msg, RoutingUpdate):
            refe.links.declared_dead(msg.view.dead)
            await self._follow_store(msg.view)
            table = msg.view.table
            if table is None:
                return
            if not self.linked:
                await refe.apply_table(table)  # first table: connect before serving, a standby too
                self.linked = True
                await self._serve()
            elif refe.offer_table(table):
                aw.work.set()  # switched at the next step boundary
        elif isinstance(msg, Wake) and not self.awake:
            log.info("woken to replace %s", msg.replaces)
            self.awake, self.woken_for = True, msg.replaces
            await self._serve()

    async def _serve(self) -> None:
        """Starts serving once both the weights and the EW links are there."""
        rt, aw = self.runtime, self.aw
        assert rt is not None and aw is not None
        if self.serving or not self.linked or not self.awake:
            return
        self.serving = True
        table = aw.refe.next_table or aw.refe.table
        with contextlib.suppress(PeerDeadError):
            await rt.send(WorkerReady(table.epoch if table is not None else 0))
        rt.spawn(aw.main_loop(rt.stop), main_loop=True)
        rt.spawn(aw.expire_loop())
        rt.ready()

    async def _rejoin_store(self) -> None:
        """Checkpoints again to the store this AW gave up on, once it answers the orchestrator.

        The running requests' KV is re-sent. This happens after a pause that doubles with each such
        loss: 0, then 1 s, up to 30 s. So a store too slow to take the AW's data is not sent all of it
        over and over."""
        await asyncio.sleep(self.store_rejoin_s)
        self.store_rejoin_s = min(30.0, max(1.0, 2 * self.store_rejoin_s))
        assert self.runtime is not None
        if self.runtime.view is not None:
            await self._follow_store(self.runtime.view)

    async def _follow_store(self, view: ClusterView) -> None:
        """Sends checkpoints to the first live checkpoint store.

        The AW connects to a new store (a replacement), or to the one it lost but the orchestrator
        vouched for. That store gets the running requests' KV again."""
        assert self.aw is not None
        ckpt = self.aw.ckpt
        if ckpt.mode == "off":
            return
        stores = view.serving(Role.STORE)
        if ckpt.active and any(w.id == ckpt.store_id for w in stores):
            return
        for w in stores:
            try:
                await ckpt.connect(w.id, w.host, w.port, list(self.aw.scheduler.running))
                return
            except PeerDeadError as exc:
                log.warning("cannot reach checkpoint store %s: %s", w.id, exc)

    def stats(self) -> WorkerStats | None:
        if self.aw is None:
            return None
        w, rt = self.weights, self.runtime
        return WorkerStats({**self.aw.stats(), "weights_mib_read": round(w.bytes_read / 2**20, 1) if w else 0.0,
                "warmup_ms": round(self.warmup_s * 1e3, 1) if self.warmup_s is not None else None,
                "compute_busy_s": round(self.clock.busy_s, 3),
                # Products shared with the helper thread, and the blocks it computed (fabric/kernels/second_core.h).
                "second_core": list(self.second_core.ops.second_core_stats()) if self.second_core is not None else None,
                "weights_mib_mapped": round(w.bytes_mapped / 2**20, 1) if w else 0.0,
                # The scale experiment reads when each epoch's view arrived. See also the engine's.
                "epochs_seen": {str(e): t for e, t in (rt.epochs_seen if rt else {}).items()}},
                           outstanding_work=self.aw.scheduler.outstanding_work())

    def leaving(self) -> None:
        # Once the orchestrator hears it, EWs close this AW's connections: expected, not a suspicion.
        if self.aw is not None:
            self.aw.refe.links.leaving()

    def abort(self) -> None:
        self.transport.abort_all()
        if self.control_transport is not None:
            self.control_transport.abort_all()

    async def close(self) -> None:
        # The store link goes first. Closing the gateways' connections lets their requests go, and
        # the store must keep those checkpoints for the AWs that resume them. What is held and queued goes
        # first (bounded), so that they restore every token computed here.
        if self.aw is not None:
            await self.aw.ckpt.close_link(drain_s=0.2)
        if self.listener is not None:
            # This closes every gateway connection too. Their requests resume elsewhere at once.
            await self.listener.close()
        if self.aw is not None:
            await self.aw.refe.close()


async def serve(cfg: AttentionWorkerConfig, stop: asyncio.Event) -> None:
    await serve_workers(cfg, lambda: AttentionService(cfg), stop)
