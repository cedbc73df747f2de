"""Checkpoint store process (Tarragon §6, FailSafe §3.2, AnchorTP §III-A).

It holds the KV cache of every AW's live requests in host memory, outside the AWs' failure domains.

Each AW connection starts with a `StoreHello` (who, and its KV layout), which gets a bucket sized
for it. Then come `KvAppend` (some layers of one step), `KvPut` (whole requests), `KvDone`
(finished requests, which are freed) and `KvSync` (a barrier).

A restoring AW sends `KvFetch(owner, request)`. The store answers with the request's committed KV
(`KvRestore`). It re-homes the request to the asking AW's bucket, so it stays protected there.
Buckets of dead AWs are kept for `--orphan-ttl-s`, then dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from checkpoint_store.log import AwBucket, CheckpointLog, KvLayout, StoreFullError
from fabric import faults
from fabric.config import CheckpointStoreConfig
from fabric.device import host_array
from fabric.errors import AuthError, PeerDeadError, ProtocolError
from fabric.messages.base import Message
from fabric.messages.checkpoint import (
    KvAppend,
    KvDone,
    KvFetch,
    KvHandOff,
    KvPut,
    KvRestore,
    KvSync,
    KvSynced,
    StoreHello,
)
from fabric.messages.control import Role, RoutingUpdate, Traits, WorkerStats
from fabric.model.config import ModelConfig
from fabric.runtime import Runtime, Service
from fabric.transport import make_transport
from fabric.transport.base import Connection, Listener, bound_elsewhere

log = logging.getLogger("checkpoint_store")

# How long a fetch from a bucket whose owner is still connected waits for the owner to go.
OWNER_GONE_WAIT_S = 5.0
# The most bytes of k and v in one KvRestore message. A message holds at least one block.
RESTORE_CHUNK_BYTES = 4 << 20
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointStore(Service):
    role = Role.STORE

    def __init__(self, cfg: CheckpointStoreConfig) -> None:
        self.cfg = cfg
        self.log = CheckpointLog()
        self.model = ModelConfig.from_dir(cfg.model)
        self.owners: dict[str, Connection] = {}  # AW -> its live connection (identity is bound to it)
        # Notified when an owner's connection ends or the owner is declared dead.
        self.owner_gone = asyncio.Condition()
        self.transport = make_transport(cfg.transport, send_timeout=cfg.send_timeout_ms / 1000,
                                        secret=cfg.secret, tls=cfg.tls)
        self.listener: Listener | None = None
        self.dead_since: dict[str, float] = {}  # AW -> when the orchestrator declared it dead
        # (owner, request) pairs the owner let go of. Another AW may take them.
        self.handed_off: set[tuple[str, str]] = set()
        self.fetches = 0
        self.fetch_hits = 0
        self.restored_tokens = 0
        self.restored_bytes = 0
        self.full_errors = 0

    # -- the role runtime's side ---------------------------------------------------------------
    async def start(self, runtime: Runtime) -> int:
        # This process only copies. A second intra-op thread buys nothing here. On a host whose cores
        # the workers keep busy, it makes every small tensor copy wait for a thread to be scheduled.
        torch.set_num_threads(1)
        self.listener = await self.transport.listen(self.cfg.host, self.cfg.port, self.handle_conn)
        runtime.spawn(self._expire())
        faults.drop_on_signal(lambda: self._drop_all(runtime))
        runtime.ready()
        log.info("checkpoint store listening on %s:%d (%s)", self.cfg.host, self.listener.port, self.transport.name)
        return self.listener.port

    def _drop_all(self, runtime: Runtime) -> None:
        for conn in list(self.owners.values()):
            runtime.spawn(conn.close())

    def registration(self) -> dict[str, Any]:
        return {"ready": True, "traits": Traits(transport=self.transport.name, bucket_mib=int(self.cfg.bucket_mib))}

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, RoutingUpdate):
            self.forget_dead(msg.view.dead)
            async with self.owner_gone:
                self.owner_gone.notify_all()

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.forget_dead([])

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()

    # -- AW connections ---------------------------------------------------------------------
    async def handle_conn(self, conn: Connection) -> None:
        hello = await conn.recv()
        if not isinstance(hello, StoreHello):
            raise ProtocolError(f"expected store_hello, got {hello.kind}")
        m = self.model
        if hello.dtype not in DTYPES or (hello.num_layers, hello.num_kv_heads, hello.head_dim) != \
                (m.num_layers, m.num_kv_heads, m.head_dim):
            raise ProtocolError(f"store_hello: a KV layout that is not this model's: {hello}")
        aw = hello.aw_id
        if aw in self.dead_since:
            raise ProtocolError(f"{aw} was declared dead")
        if await bound_elsewhere(self.owners.get(aw), KvSynced(-1)):
            raise AuthError(f"{conn.peer} claims {aw}, which is connected")
        if aw not in self.log.buckets and len(self.log.buckets) >= self.cfg.max_aws:
            raise ProtocolError(f"{aw}: this store already keeps {self.cfg.max_aws} attention workers' checkpoints")
        layout = KvLayout(hello.num_layers, hello.num_kv_heads, hello.head_dim, DTYPES[hello.dtype])
        # A live AW is back after its link dropped. It re-sends its running requests' KV, and those
        # that finished meanwhile would never hear their KvDone here.
        if aw in self.log.buckets:
            self.log.drop_aw(aw)
        bucket = self.log.bucket(aw, layout, self.cfg.bucket_mib << 20)
        self.owners[aw] = conn
        log.info("%s checkpoints here (%d layers, %d kv heads x %d, %s)", aw, layout.num_layers,
                 layout.num_kv_heads, layout.head_dim, hello.dtype)
        try:
            await self._serve_aw(conn, hello, bucket)
        finally:
            if self.owners.get(aw) is conn:
                del self.owners[aw]
            async with self.owner_gone:
                self.owner_gone.notify_all()

    async def _serve_aw(self, conn: Connection, hello: StoreHello, bucket: AwBucket) -> None:
        fetches: set[asyncio.Task[None]] = set()  # a restore's chunks go out beside this AW's appends
        try:
            await self._read_aw(conn, hello, bucket, fetches)
        finally:
            for task in fetches:
                task.cancel()

    async def _read_aw(self, conn: Connection, hello: StoreHello, bucket: AwBucket,
                       fetches: set[asyncio.Task[None]]) -> None:
        while True:
            msg = await conn.recv()
            if isinstance(msg, KvAppend):
                self._append(bucket, msg)
            elif isinstance(msg, KvPut):
                self._check(bucket.layout, msg.k, msg.v, 4)
                if msg.k.shape[0] != bucket.layout.num_layers:
                    raise ProtocolError("kv_put: k must hold every layer")
                self._check_span(msg.start, msg.k.shape[1])
                self._owned_again(bucket, [msg.request_id])
                try:
                    bucket.put_tokens(msg.request_id, msg.start, msg.k, msg.v)
                except StoreFullError as exc:
                    self.full_errors += 1
                    log.warning("%s: %s", hello.aw_id, exc)
            elif isinstance(msg, KvDone):
                for rid in msg.request_ids:
                    bucket.finish(rid)
            elif isinstance(msg, KvHandOff):
                await self._hand_off(hello.aw_id, bucket, msg.request_ids)
            elif isinstance(msg, KvSync):
                await conn.send(KvSynced(msg.nonce))
            elif isinstance(msg, KvFetch):
                # Sends are whole messages on every transport, so nothing interleaves.
                task = asyncio.create_task(self._fetch_quietly(msg, hello.aw_id, bucket, conn))
                fetches.add(task)
                task.add_done_callback(fetches.discard)
            else:
                raise ProtocolError(f"unexpected {msg.kind} on a checkpoint connection")

    @staticmethod
    def _check(layout: KvLayout, k: torch.Tensor, v: torch.Tensor, dims: int) -> None:
        if k.shape != v.shape or k.dim() != dims or k.dtype != layout.dtype or v.dtype != layout.dtype:
            raise ProtocolError(f"checkpoint KV of shape {tuple(k.shape)} {k.dtype} does not fit the layout")
        if tuple(k.shape[-2:]) != (layout.num_kv_heads, layout.head_dim):
            raise ProtocolError(f"checkpoint KV of shape {tuple(k.shape)} does not fit the layout")

    def _check_span(self, start: int, count: int) -> None:
        """Checks that token positions are within the model's context.

        Nothing is allocated for a position no request can reach.
        """
        if not 0 <= start <= start + count <= self.model.max_position:
            raise ProtocolError(f"checkpoint tokens {start}..+{count} are outside the model's context "
                                f"({self.model.max_position})")

    def _append(self, bucket: AwBucket, msg: KvAppend) -> None:
        """k, v [m, T, K, d]: layers msg.layer .. +m-1, columns grouped per request span."""
        self._check(bucket.layout, msg.k, msg.v, 4)
        if not 0 <= msg.layer < msg.layer + msg.k.shape[0] <= bucket.layout.num_layers:
            raise ProtocolError(f"kv_append: layers {msg.layer}..+{msg.k.shape[0]} out of range")
        if not len(msg.request_ids) == len(msg.starts) == len(msg.counts) or sum(msg.counts) != msg.k.shape[1] \
                or any(c < 0 for c in msg.counts) or any(s < 0 for s in msg.starts):
            raise ProtocolError("kv_append: spans do not match the columns")
        for start, count in zip(msg.starts, msg.counts):
            self._check_span(start, count)
        self._owned_again(bucket, msg.request_ids)
        col, k, v = 0, host_array(msg.k), host_array(msg.v)  # (numpy's slices: ~0.2 µs each, torch's ~2)
        for rid, start, count in zip(msg.request_ids, msg.starts, msg.counts):
            try:
                bucket.append_layers(rid, msg.layer, start, msg.seq_no, k[:, col:col + count], v[:, col:col + count])
            except StoreFullError as exc:
                self.full_errors += 1
                log.warning("%s: %s", rid, exc)
            col += count

    def _owned_again(self, bucket: AwBucket, request_ids: list[str]) -> None:
        """Reclaims handed-off requests that their owner writes to again.

        Such a request came back to its owner. It is the owner's own again, neither evictable nor
        free for another AW's fetch.
        """
        if not self.handed_off:
            return
        for rid in request_ids:
            if (bucket.aw_id, rid) in self.handed_off:
                self.handed_off.discard((bucket.aw_id, rid))
                if (req := bucket.requests.get(rid)) is not None:
                    req.orphaned = False

    async def _hand_off(self, owner: str, bucket: AwBucket, request_ids: list[str]) -> None:
        """Handles the owner letting go of these requests, which resume on another AW.

        They are kept, evictable, and free for that AW's fetch, which may be waiting already.
        """
        for rid in request_ids:
            req = bucket.requests.get(rid)
            if req is not None:
                req.orphaned = True
                self.handed_off.add((owner, rid))
        async with self.owner_gone:
            self.owner_gone.notify_all()

    async def _fetch_quietly(self, msg: KvFetch, asker: str, bucket: AwBucket, conn: Connection) -> None:
        try:
            await self._fetch(msg, asker, bucket, conn)
        except PeerDeadError:
            pass  # the asker is gone: its restore with it
        except Exception:
            # A bug. The connection is closed, so the asker replays instead of waiting.
            log.exception("restoring %s of %s to %s failed", msg.request_id, msg.owner, asker)
            await conn.close()

    async def _fetch(self, msg: KvFetch, asker: str, bucket: AwBucket, conn: Connection) -> None:
        """Sends the request's committed KV in chunks of whole blocks (`RESTORE_CHUNK_BYTES`)."""
        self.fetches += 1
        if msg.owner != asker and not await self._owner_gone(msg.owner, msg.request_id):
            log.warning("%s asked for %s of %s, which still holds it: refused", asker, msg.request_id, msg.owner)
            await conn.send(KvRestore(msg.call_id, 0, 0, *bucket.layout.empty_kv()))
            return
        self.handed_off.discard((msg.owner, msg.request_id))
        owner = self.log.buckets.get(msg.owner)
        req = owner.requests.get(msg.request_id) if owner is not None else None
        n = min(req.frontier, max(0, msg.max_tokens)) if req is not None else 0
        if req is None or n == 0:
            log.info("fetch %s from %s: nothing stored", msg.request_id, msg.owner)
            await conn.send(KvRestore(msg.call_id, 0, 0, *bucket.layout.empty_kv()))
            return
        self.log.move(msg.request_id, msg.owner, asker)  # protected on its new AW from now on
        self.fetch_hits += 1
        self.restored_tokens += n
        # The asker sends nothing for this request until its restore ends. Committed tokens are never
        # rewritten. So the blocks stay as they are while their chunks are on the way.
        for start, k, v in req.chunks(n, RESTORE_CHUNK_BYTES):  # k, v [L, c, K, d]
            await conn.send(KvRestore(msg.call_id, n, start, k, v))
            self.restored_bytes += k.numel() * k.element_size() * 2
        log.info("restored %s (%d tokens) from %s's bucket to %s", msg.request_id, n, msg.owner, asker)

    async def _owner_gone(self, owner: str, request_id: str) -> bool:
        """Waits, bounded, until the owner is gone or has handed the request over; True if so.

        A bucket is served to its owner, or to another AW once the owner is gone or has handed the
        request over. The owner is gone once its connection ended (the process died) or the
        orchestrator declared it dead (a hung one). A restore races the owner's death by a few ms,
        and a silent owner's verdict or hand-off by up to a lease. So a fetch waits for it, bounded.
        """

        def gone() -> bool:
            conn = self.owners.get(owner)
            return (conn is None or conn.closed or owner in self.dead_since
                    or (owner, request_id) in self.handed_off)

        async with self.owner_gone:
            try:
                await asyncio.wait_for(self.owner_gone.wait_for(gone), OWNER_GONE_WAIT_S)
            except TimeoutError:
                return False
        return True

    def forget_dead(self, dead: list[str]) -> None:
        now = time.monotonic()
        for aw in dead:
            if aw in self.log.buckets and aw not in self.dead_since:
                self.dead_since[aw] = now
                self.log.orphan(aw)
        for aw, since in list(self.dead_since.items()):
            if now - since > self.cfg.orphan_ttl_s:
                self.log.drop_aw(aw)
                del self.dead_since[aw]
        # Drop hand-offs of requests evicted or dropped since.
        buckets = self.log.buckets
        self.handed_off = {(o, r) for o, r in self.handed_off if o in buckets and r in buckets[o].requests}

    def stats(self) -> WorkerStats:
        return WorkerStats({
            "buckets": len(self.log.buckets), "requests": sum(len(b.requests) for b in self.log.buckets.values()),
            "bytes_used": self.log.bytes_used, "fetches": self.fetches, "restores": self.fetch_hits,
            "restored_tokens": self.restored_tokens, "restored_bytes": self.restored_bytes,
            "store_full_errors": self.full_errors,
            "per_aw": {aw: b.stats() for aw, b in self.log.buckets.items()},
        })


async def serve(cfg: CheckpointStoreConfig, stop: asyncio.Event) -> None:
    await Runtime(cfg, CheckpointStore(cfg)).serve(stop)
