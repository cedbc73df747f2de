"""Hostile peers against a running fabric, on every internal port of every role, over tcp, tcp's
same-host sockets and ucx:
a peer without the cluster secret, with a wrong one, or replaying a recorded handshake is refused
before any message of it is read; an authenticated peer that claims another worker's identity is
refused; the admin endpoints want the secret; and through all of it every process keeps serving,
token for token as before."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import urllib.error
import urllib.request
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import torch

from fabric import auth
from fabric.control_link import pack, unpack, ws_channel
from fabric.errors import PeerDeadError
from fabric.messages.base import Message, encode_message
from fabric.messages.checkpoint import KvFetch, KvPut, KvRestore, KvSync, KvSynced, StoreHello
from fabric.messages.control import Fenced, Register, Registered, Role, Traits
from fabric.messages.expert import ExpertCall
from fabric.messages.liveness import Hello, Ping, Pong
from fabric.model.config import ModelConfig
from fabric.transport.base import Connection
from launch.local import Fabric
from tests.conftest import running_fabric
from tests.helpers import dialer, fabric_transport, post_json, replay_handshake, same_host_on, wait_for

BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
WRONG = b"w" * 32


def workers(fabric: Fabric, role: str) -> list[dict[str, Any]]:
    return [w for w in fabric.cluster()["workers"] if w["role"] == role]


async def refused(conn: Connection) -> bool:
    """Whether the far side closes `conn` (a guard of 30 s, not a timing assertion)."""
    try:
        while True:
            await asyncio.wait_for(conn.recv(), 30)
    except PeerDeadError:
        return True
    finally:
        await conn.close()


async def outsiders(name: str, port: int, secret: bytes) -> None:
    """No handshake, a wrong secret, and a replayed handshake: all refused."""
    bare = await dialer(name).connect("127.0.0.1", port)
    await bare.send(Hello("aw-0", "control"))  # a valid message, but no proof first
    assert await refused(bare)

    with pytest.raises(PeerDeadError, match="authentication failed"):
        await dialer(name, WRONG).connect("127.0.0.1", port)

    await replay_handshake(name, port, secret)  # a recorded handshake, replayed


async def ask(conn: Connection, msg: Message) -> Message:
    await conn.send(msg)
    return await asyncio.wait_for(conn.recv(), 30)


async def impostors(name: str, fabric: Fabric, secret: bytes) -> None:
    """Authenticated peers that claim another worker's identity, and insiders' bad values."""
    aw = workers(fabric, "attention")[0]["id"]
    model = ModelConfig.from_dir(fabric.cfg.model or "")
    transport = dialer(name, secret)
    control = dialer("tcp" if name == "ucx" else name, secret)  # (control ports are TCP whatever the data transport)

    for ew in workers(fabric, "expert"):
        # A second control channel for a connected AW: refused (the AW's own stays up).
        conn = await control.connect("127.0.0.1", ew["control_port"])
        await conn.send(Hello(aw, "control"))
        assert await refused(conn)
        # A new AW id is fine; a message the channel does not carry closes it.
        conn = await control.connect("127.0.0.1", ew["control_port"])
        await conn.send(Hello("aw-insider", "control"))
        assert isinstance(await ask(conn, Ping(1)), Pong)
        await conn.send(Hello("aw-insider", "data"))
        assert await refused(conn)
        # A control hello on the data port: refused.
        conn = await transport.connect("127.0.0.1", ew["port"])
        await conn.send(Hello("aw-insider", "control"))
        assert await refused(conn)
        # A new AW id on the data port is fine, but a call whose counts are not whole numbers closes it.
        conn = await transport.connect("127.0.0.1", ew["port"])
        await conn.send(Hello("aw-insider", "data"))
        header_counts = ExpertCall(1, 0, 0, [0, 1], [1, 1], torch.zeros(2, model.hidden_size, dtype=model.torch_dtype))
        await conn.send(header_counts)  # well-formed: answered (a result or an error), the link stays up
        assert (await asyncio.wait_for(conn.recv(), 30)).kind in ("expert_result", "expert_error")
        await conn.send(ExpertCall(2, 0, 0, [0, 1], [3, 3], torch.zeros(2, model.hidden_size, dtype=model.torch_dtype)))  # counts != rows
        assert await refused(conn)
        conn = await transport.connect("127.0.0.1", ew["port"])
        await conn.send(Hello("aw-insider", "data"))
        header, frames = encode_message(header_counts)
        await conn.send_raw({**header, "counts": [0.5, 0.5]}, frames)  # right sum, not whole numbers
        assert await refused(conn)

    store = workers(fabric, "checkpoint_store")[0]["port"]
    layout = (model.num_layers, model.num_kv_heads, model.head_dim, "float32")
    conn = await transport.connect("127.0.0.1", store)  # a live AW's identity: refused
    await conn.send(StoreHello(aw, *layout))
    assert await refused(conn)
    conn = await transport.connect("127.0.0.1", store)  # another model's layout: refused
    await conn.send(StoreHello("aw-insider", model.num_layers + 1, model.num_kv_heads, model.head_dim, "float32"))
    assert await refused(conn)
    kv = torch.ones(model.num_layers, 2, model.num_kv_heads, model.head_dim)
    conn = await transport.connect("127.0.0.1", store)  # a token position past the context: refused
    await conn.send(StoreHello("aw-insider", *layout))
    await conn.send(KvPut(1, "r", 1_000_000, kv, kv))
    assert await refused(conn)

    # A bucket is served only to its owner, or to another AW once the owner is gone.
    owner = await transport.connect("127.0.0.1", store)
    await owner.send(StoreHello("aw-owner", *layout))
    await owner.send(KvPut(1, "victim", 0, kv, kv))
    assert isinstance(await ask(owner, KvSync(1)), KvSynced)
    thief = await transport.connect("127.0.0.1", store)
    await thief.send(StoreHello("aw-thief", *layout))
    got = await ask(thief, KvFetch(1, "aw-owner", "victim", 100))
    assert isinstance(got, KvRestore) and got.frontier == 0  # the owner is connected: nothing
    await owner.close()  # the owner is gone: a restore is what the bucket is for
    got = await ask(thief, KvFetch(2, "aw-owner", "victim", 100))
    assert isinstance(got, KvRestore) and got.frontier == 2 and torch.equal(got.k, kv)
    await thief.close()
    # Buckets are bounded (--max-aws 4 here: the real AW's, aw-insider's, aw-owner's, aw-thief's).
    conn = await transport.connect("127.0.0.1", store)
    await conn.send(StoreHello("aw-flood", *layout))
    assert await refused(conn)


async def control_plane(fabric: Fabric, secret: bytes) -> None:
    """The orchestrator's /ws: outsiders, an identity claim, an oversized registration, a worker
    at an address that does not resolve."""
    url = f"http://127.0.0.1:{fabric.orchestrator_port}/ws"
    aw = workers(fabric, "attention")[0]
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url) as ws:  # a registration without the handshake
            await ws.send_bytes(pack(Register(Role.ATTENTION, 1, "127.0.0.1", 1)))
            msg = await asyncio.wait_for(ws.receive(), 30)  # closed: nothing was registered
            assert msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED), msg
        async with session.ws_connect(url) as ws:
            with pytest.raises(auth.AuthError):
                await auth.dialer_handshake(WRONG, *ws_channel(ws), url)

        async def register(reg: Register) -> Message | None:
            async with session.ws_connect(url, max_msg_size=64 << 20) as ws:
                await auth.dialer_handshake(secret, *ws_channel(ws), url)
                await ws.send_bytes(pack(reg))
                msg = await asyncio.wait_for(ws.receive(), 30)
                return unpack(msg.data) if msg.type == aiohttp.WSMsgType.BINARY else None

        # Another worker's id, while its link is up and answering: refused, and the AW stays.
        assert await register(Register(Role.ATTENTION, 4242, "127.0.0.1", 1, worker_id=aw["id"])) is None
        # A ~700 KB node name: refused (it would have gone into /cluster and every later update).
        huge = Traits()
        huge.node = "y" * 700_000  # (past the check a sender's own constructor makes)
        assert await register(Register(Role.EXPERT, 4243, "127.0.0.1", 1, traits=huge)) is None
        # An insider registering an AW at an address that does not resolve: the gateways try
        # it, fail, and keep serving.
        async with session.ws_connect(url) as ws:
            await auth.dialer_handshake(secret, *ws_channel(ws), url)
            await ws.send_bytes(pack(Register(Role.ATTENTION, 4244, "no-such-host.invalid", 9, ready=True)))
            reply = unpack((await asyncio.wait_for(ws.receive(), 30)).data)
            assert isinstance(reply, Registered | Fenced)
            # The gateways dial it, fail, and report it; the orchestrator's probe (unanswered here)
            # confirms: it is declared dead.
            await asyncio.to_thread(wait_for, fabric, "the unreachable AW declared dead", lambda c: any(
                w["pid"] == 4244 and w["state"] == "dead" for w in c["workers"]), 60)
            status, _ = await asyncio.to_thread(post_json, f"http://127.0.0.1:{fabric.port}/v1/completions", BODY)
            assert status == 200
    after = next(w for w in workers(fabric, "attention") if w["id"] == aw["id"])
    assert after["pid"] == aw["pid"] and after["state"] == "alive"


def test_nothing_listens_openly_without_a_secret(hf_models: dict[str, Path]) -> None:
    """A non-loopback listener, or a ucx one (ucxx binds every interface), needs a secret."""
    env = {k: v for k, v in os.environ.items() if k != auth.SECRET_ENV}
    model = hf_models["mixtral"]
    for args in (["--host", "0.0.0.0", "--transport", "tcp"], ["--transport", "ucx"]):
        r = subprocess.run([sys.executable, "-m", "launch.cli", "checkpoint-store", "--model", str(model),
                            "--orchestrator", "127.0.0.1:9", *args], capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode != 0 and "secret" in r.stderr, (args, r.stderr[-2000:])
    r = subprocess.run([sys.executable, "-m", "launch.cli", "orchestrator", "--model", str(model), "--expert-workers", "1",
                        "--host", "0.0.0.0"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "secret" in r.stderr, r.stderr[-2000:]


def admin_endpoints(fabric: Fabric, secret: bytes) -> None:
    base = f"http://127.0.0.1:{fabric.orchestrator_port}"
    for path, method in [("/cluster", "GET"), ("/shutdown", "POST")]:
        for headers in [{}, {"Authorization": f"Bearer {WRONG.decode()}"}, {"Authorization": secret.decode()}]:
            req = urllib.request.Request(base + path, data=b"" if method == "POST" else None, method=method,
                                         headers=headers)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(req, timeout=10)
            assert err.value.code == 401, (path, headers)
    assert fabric.cluster()["workers"]  # with the secret: answered


TRANSPORTS = ["tcp", "unix",
              pytest.param("ucx", marks=pytest.mark.skipif(find_spec("ucxx") is None, reason="needs the [ucx] extra"))]


@pytest.mark.parametrize("name", TRANSPORTS)
def test_hostile_peers_are_refused_and_the_fabric_serves_on(name: str, hf_models: dict[str, Path],
                                                           tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    same_host_on(name, monkeypatch)
    with running_fabric(hf_models["mixtral"], tmp_path, transport=fabric_transport(name), aws=1, ews=2,
                        extra={"checkpoint-store": ["--max-aws", "4"]}) as fabric:
        base = f"http://127.0.0.1:{fabric.port}/v1/completions"
        status, before = post_json(base, BODY)
        assert status == 200
        secret = fabric.supervisor.secret
        assert secret is not None
        pids = {w["id"]: w["pid"] for w in fabric.cluster()["workers"]}
        ports = [w["port"] for w in fabric.cluster()["workers"]
                 if w["role"] in ("attention", "expert", "checkpoint_store")]
        assert len(ports) == 4
        control_ports = [w["control_port"] for w in fabric.cluster()["workers"] if w["role"] != "orchestrator"]
        assert len(control_ports) == 6 and all(control_ports)  # every worker's, the gateways' included

        async def peers() -> None:
            for port in ports:
                await outsiders(name, port, secret)
            for port in control_ports:
                await outsiders("tcp" if name == "ucx" else name, port, secret)
            await impostors(name, fabric, secret)
            if name == "tcp":  # the orchestrator's link is a websocket whatever the transport
                await control_plane(fabric, secret)

        if name == "tcp":
            admin_endpoints(fabric, secret)
        asyncio.run(peers())
        assert all(proc.poll() is None for _, proc in fabric.procs), "a process died"
        status, after = post_json(base, BODY)
        assert status == 200 and after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
        now = {w["id"]: w["pid"] for w in fabric.cluster()["workers"] if w["id"] in pids}
        assert now == pids  # nobody was replaced: every worker kept serving
        wait_for(fabric, "every worker alive",
                 lambda c: all(w["state"] == "alive" for w in c["workers"] if w["id"] in pids), 30)
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert logs.count("refused a connection") >= 3 * len(ports)  # each outsider was logged
