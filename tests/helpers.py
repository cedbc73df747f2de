"""Small factories and clients shared by tests (no sockets in the factories)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from launch.local import free_port

__all__ = ["free_port"]


def write_hf_model(out: Path, arch: str, seed: int = 0, **overrides: Any) -> Path:
    """A small random checkpoint written by transformers itself. initializer_range is raised so
    logits are peaked enough that greedy choices are rarely near-ties. `overrides` go into the config."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  num_experts_per_tok=2, max_position_embeddings=512, initializer_range=0.1, eos_token_id=2, bos_token_id=1)
    if arch == "mixtral":
        model: Any = MixtralForCausalLM(MixtralConfig(**{"intermediate_size": 96, "num_local_experts": 6, **common,
                                                         **overrides}))
    else:
        cfg = Qwen3MoeConfig(**{"intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 6, "head_dim": 16,
                                "norm_topk_prob": True, **common, **overrides})
        model = Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(out)
    return out


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get_json(url: str, timeout: float = 10, secret_file: Path | None = None) -> dict[str, Any]:
    """GET `url`; with `secret_file`, as an admin (`Authorization: Bearer <cluster secret>`)."""
    headers = {"Authorization": f"Bearer {secret_file.read_text().strip()}"} if secret_file else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return json.loads(r.read())


def iter_events(url: str, body: dict[str, Any], timeout: float = 120, headers: dict[str, str] | None = None,
                served_by: list[str] | None = None) -> Iterator[tuple[str | None, dict[str, Any]]]:
    """Raw SSE client yielding (event id, decoded `data:` payload) as each event arrives; asserts
    the stream ends with [DONE]. `served_by` gets the id of the gateway that answered."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream",
                                          **(headers or {})})
    done = False
    event_id: str | None = None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        if served_by is not None:
            served_by.append(r.headers.get("X-Moe-Fabric-Gateway", ""))
        for raw in r:
            line = raw.decode().strip()
            if not line:
                event_id = None
                continue
            if line.startswith("id: "):
                event_id = line[4:]
                continue
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            yield event_id, json.loads(payload)
    assert done, "stream ended without [DONE]"


def iter_stream(url: str, body: dict[str, Any], timeout: float = 120) -> Iterator[dict[str, Any]]:
    """The payloads of `iter_events`."""
    for _, payload in iter_events(url, body, timeout):
        yield payload


def stream_completion(url: str, body: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
    return list(iter_stream(url, body, timeout))


def resumable_stream(url: str, body: dict[str, Any], timeout: float = 120, deadline: float = 120,
                     served_by: list[str] | None = None,
                     on_event: Callable[[dict[str, Any]], None] | None = None) -> tuple[list[dict[str, Any]], int]:
    """A streaming client that does what a robust one should: when its stream breaks (its gateway
    died), it sends the same request again with `Last-Event-ID`. Returns (every payload, in order,
    once; how many times it resumed); `served_by` gets the gateway of every attempt."""
    events: list[dict[str, Any]] = []
    last: str | None = None
    resumes = 0
    end = time.monotonic() + deadline
    while True:
        try:
            for event_id, payload in iter_events(url, body, timeout, {"Last-Event-ID": last} if last else None,
                                                 served_by):
                events.append(payload)
                last = event_id or last
                if on_event is not None:
                    on_event(payload)
            return events, resumes
        except (OSError, AssertionError, http.client.HTTPException) as exc:
            if isinstance(exc, urllib.error.HTTPError) and exc.code not in (502, 503):
                raise
            if isinstance(exc, AssertionError) and "without [DONE]" not in str(exc):
                raise
            assert time.monotonic() < end, f"no complete stream within {deadline} s: {exc}"
            resumes += 1
            time.sleep(0.05)


def poll_until(cond: Callable[[], bool], timeout: float = 60, interval: float = 0.02) -> bool:
    """Whether `cond()` became true within `timeout` (polled; not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def wait_for(fabric: Any, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 90) -> dict[str, Any]:
    """Polls the cluster view until `pred` holds (an orchestrator that is restarting is waited for)."""
    deadline = time.monotonic() + timeout
    cluster: dict[str, Any] = {}
    while True:
        try:
            cluster = fabric.cluster()
            if pred(cluster):
                return cluster
        except OSError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {cluster.get('workers')}"
        time.sleep(0.2)


def replacement_of(cluster: dict[str, Any], dead_id: str) -> dict[str, Any] | None:
    return next((w for w in cluster["workers"] if w["info"].get("replaces") == dead_id and w["state"] == "alive"), None)


def worker_by_pid(cluster: dict[str, Any], pid: int) -> dict[str, Any]:
    return next(w for w in cluster["workers"] if w["pid"] == pid)


DIALERS = ("tcp", "unix", "ucx")  # how a test dials a listener: the transports the fabric uses


def dialer(name: str, secret: bytes | None = None) -> Any:
    """A transport that dials as `name` says: tcp (the TCP port only), unix (the same-host socket
    that a tcp listener on this machine has beside its port; asserted to be the one used), or ucx."""
    import socket

    from fabric.transport import make_transport, same_host
    from fabric.transport.tcp import TcpTransport

    if name == "ucx":
        return make_transport("ucx", secret=secret)
    if name == "tcp":
        return TcpTransport(secret=secret, same_host_sockets=False)

    assert same_host.enabled(), f"dialing over same-host sockets wants {same_host.ENABLE}=1 (tests: same_host_on)"

    class SameHost(TcpTransport):
        async def connect(self, host: str, port: int, timeout: float = 10.0) -> Any:
            path = same_host.path(host, port)
            assert path is not None and os.path.exists(path), f"no same-host socket for {host}:{port}"
            conn = await super().connect(host, port, timeout)
            assert conn._transport.get_extra_info("socket").family == socket.AF_UNIX
            return conn

    return SameHost(secret=secret)


def same_host_on(dialer_name: str, monkeypatch: Any) -> None:
    """The links a test names, for it and the processes it starts: unix, the same-host sockets (the default);
    tcp, TCP alone (same-host sockets off)."""
    from fabric.transport import same_host

    monkeypatch.setenv(same_host.ENABLE, "1" if dialer_name == "unix" else "0")


def fabric_transport(dialer_name: str) -> str:
    """The fabric transport under a dialer's name (the same-host sockets are tcp's)."""
    return "tcp" if dialer_name == "unix" else dialer_name


async def replay_handshake(transport: str, port: int, secret: bytes) -> None:
    """Records a real dialer's handshake bytes (accepted), then plays them to a new connection:
    the listener's nonce is fresh, so the recorded proof is stale and the replay is refused."""
    from fabric import auth
    from fabric.errors import PeerDeadError

    rec = await dialer(transport).connect("127.0.0.1", port)
    hello = auth.MAGIC + os.urandom(auth.NONCE)
    await rec._write_bytes(hello)
    reply = bytes(await rec._read_exactly(auth.LISTENER_PROOF))
    proof = auth._mac(auth._key(secret), b"dialer", reply[:auth.NONCE], hello[len(auth.MAGIC):])
    await rec._write_bytes(proof)
    assert bytes(await rec._read_exactly(1)) == auth.ACCEPT  # the original exchange is accepted
    await rec.close()
    replay = await dialer(transport).connect("127.0.0.1", port)
    try:
        await replay._write_bytes(hello)
        await replay._read_exactly(auth.LISTENER_PROOF)
        await replay._write_bytes(proof)
        try:
            await asyncio.wait_for(replay._read_exactly(1), 30)
        except PeerDeadError:
            return
        raise AssertionError("a replayed handshake was accepted")
    finally:
        await replay.close()


def reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: list[list[int]], lens: list[int],
                     s: int, scale: float, window: int) -> torch.Tensor:
    """The AW's attention for one query per sequence, over slots gathered from the block table."""
    heads, kv_heads = q.shape[1], k.shape[1]
    out = torch.zeros(q.shape)
    for b, (table, n) in enumerate(zip(tables, lens)):
        pos = [p for p in range(n) if (not window or p > n - 1 - window)]
        slots = torch.tensor([table[p // s] * s + p % s for p in pos])
        kk = k[slots].repeat_interleave(heads // kv_heads, dim=1)  # [L, H, d]
        vv = v[slots].repeat_interleave(heads // kv_heads, dim=1)
        att = torch.softmax(torch.einsum("hd,lhd->hl", q[b], kk) * scale, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", att, vv)
    return out
