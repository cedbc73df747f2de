"""Random bytes, truncated frames and oversized length headers thrown at the internal ports of AWs,
EWs, the checkpoint store and the orchestrator by a peer that holds the cluster secret (so the
decoders, not the handshake, meet them): each bad connection is closed, every process keeps serving.
Peers without the secret are tests/system/test_hostile_peers.py's."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from pathlib import Path

import aiohttp
import msgpack
import pytest
import torch

from fabric import auth
from fabric.control_link import ws_channel
from fabric.errors import PeerDeadError
from fabric.messages.base import encode_message
from fabric.messages.expert import ExpertCall
from fabric.messages.liveness import Hello
from fabric.wire import MAGIC, PREFIX, encode, encode_bytes
from launch.local import Fabric
from tests.conftest import running_fabric
from tests.helpers import post_json


def prefix(header_len: int, n_frames: int, body_len: int, magic: bytes = MAGIC) -> bytes:
    return PREFIX.pack(magic, header_len, n_frames, body_len)


def msg_bytes(header: dict, frames: list[bytes] | None = None) -> bytes:
    return b"".join(bytes(b) for b in encode(header, frames or []))


def nested(depth: int) -> object:
    obj: object = 1
    for _ in range(depth):
        obj = [obj]
    return obj


def hello_then(payload: bytes) -> bytes:
    header, frames = encode_message(Hello("fuzzer", "data"))
    return msg_bytes(header, [bytes(f) for f in frames]) + payload


def truncated_payloads() -> list[bytes]:
    """Frames cut short: a server can only see them as bad once the sender leaves."""
    return [
        prefix(100, 0, 100)[:10],  # truncated prefix
        prefix(100, 0, 5000) + b"\x81" * 50,  # truncated body
    ]


def bad_payloads() -> list[bytes]:
    return rejected_payloads() + truncated_payloads()


def rejected_payloads() -> list[bytes]:
    """Frames a server rejects as they arrive (it closes the connection with a logged error)."""
    rng = os.urandom
    bad_call = ExpertCall(1, 1, 0, [0], [5], torch.zeros(3, 64))  # counts disagree with rows
    header, frames = encode_message(bad_call)
    wrong_shape = dict(header, x=["float32", [1000, 1000], 0])  # frame far smaller than the shape
    return [
        rng(4096),
        prefix(2**31, 0, 2**31),  # oversized header length
        prefix(10, 2**20, 2**40),  # oversized frame count and body
        prefix(10, 0, 10, magic=b"XXXX") + b"0" * 10,  # bad magic
        prefix(4, 0, 4) + b"\xc1\xc1\xc1\xc1",  # undecodable msgpack
        msg_bytes({"kind": "no-such-kind"}),
        msg_bytes({"kind": "hello", "aw_id": 5, "channel": [1]}),  # wrong field types
        msg_bytes({"kind": "hello", "aw_id": "x", "channel": nested(100)}),  # too deep
        msg_bytes({"nokind": 1}),
        hello_then(msg_bytes(header, [bytes(f) for f in frames])),
        hello_then(msg_bytes(wrong_shape, [bytes(f) for f in frames])),
        hello_then(rng(2048)),
        struct.pack("<4sIIQ", MAGIC, 8, 1, 7) + b"\x00" * 7,  # lengths that do not add up
    ]


def prove(sock: socket.socket, secret: bytes) -> None:
    """The dialer's side of the cluster handshake (fabric/auth.py) on a plain socket."""
    nd = os.urandom(auth.NONCE)
    sock.sendall(auth.MAGIC + nd)
    reply = recv_exactly(sock, auth.LISTENER_PROOF)
    key = auth._key(secret)
    assert reply[auth.NONCE:] == auth._mac(key, b"listener", nd, reply[:auth.NONCE])
    sock.sendall(auth._mac(key, b"dialer", reply[:auth.NONCE], nd))
    assert recv_exactly(sock, 1) == auth.ACCEPT


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "closed during the handshake"
        data += chunk
    return data


def throw(port: int, payload: bytes, secret: bytes | None) -> None:
    """Sends `payload` (after the handshake, given the secret), half-closes, and waits until the
    server closes (or 5 s pass)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        if secret is not None:
            prove(s, secret)
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            while s.recv(65536):
                pass
        except (ConnectionError, TimeoutError, OSError):
            pass


async def throw_ws(port: int, secret: bytes) -> None:
    async with aiohttp.ClientSession() as session:
        for payload in [os.urandom(512), encode_bytes({"kind": "register", "role": "boss"}), b"x" * (2 << 20),
                        msgpack.packb({"kind": "register"})]:
            try:
                async with session.ws_connect(f"http://127.0.0.1:{port}/ws") as ws:
                    await auth.dialer_handshake(secret, *ws_channel(ws), "orchestrator")
                    await ws.send_bytes(payload)
                    await asyncio.wait_for(ws.receive(), 5)
            except (TimeoutError, ConnectionError, aiohttp.ClientError):
                pass  # the server may close the socket while the client is still sending
        async with session.post(f"http://127.0.0.1:{port}/ws", data=os.urandom(1000)) as r:
            assert r.status >= 400


BODY = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def serve_once_and_list_ports(fabric: Fabric, workers: int) -> tuple[str, dict, list[int]]:
    """The completions URL, a first completion (the reference) and the internal ports of every
    AW and EW."""
    base = f"http://127.0.0.1:{fabric.port}/v1/completions"
    status, before = post_json(base, BODY)
    assert status == 200
    cluster = fabric.cluster()
    ports = [w["port"] for w in cluster["workers"] if w["role"] in ("attention", "expert", "checkpoint_store")]
    assert len(ports) == workers
    return base, before, ports


def test_internal_ports_survive_garbage(hf_models: dict[str, Path], tmp_path: Path) -> None:
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3) as fabric:
        base, before, ports = serve_once_and_list_ports(fabric, 6)
        body = BODY
        secret = fabric.supervisor.secret
        assert secret is not None
        for port in ports:
            for payload in bad_payloads():
                throw(port, payload, secret)
        for payload in [os.urandom(3000), b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n", b"\x00" * 100]:
            throw(fabric.orchestrator_port, payload, None)
        asyncio.run(throw_ws(fabric.orchestrator_port, secret))
        assert all(proc.poll() is None for _, proc in fabric.procs), "a process died"
        status, after = post_json(base, body)
        assert status == 200 and after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
        cluster = fabric.cluster()
        assert all(w["state"] == "alive" for w in cluster["workers"]), cluster
        # a checkpoint without a tokenizer serves token ids, and says so for text
        status, err = post_json(base, {"prompt": "hello", "max_tokens": 4})
        assert status == 400 and "token ids" in err["error"]["message"]
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert "closing connection from" in logs  # the bad connections were logged, not silently dropped


def ucx_payloads() -> list[tuple[list[bytes], bool]]:
    """Every TCP payload again, over real UCX endpoints (the byte stream the transport frames
    messages on), plus a prefix and body sent as separate UCX sends and a valid message followed
    by garbage: (one connection's UCX sends, whether the server rejects them as they arrive)."""
    rejected = [[p] for p in rejected_payloads()] + [
        [prefix(4, 0, 4), b"\xc1\xc1\xc1\xc1"],
        [hello_then(msg_bytes({"kind": "ping", "nonce": 1})), os.urandom(5000)],
    ]
    truncated = [[p] for p in truncated_payloads()] + [[prefix(8, 0, 100), os.urandom(50)]]
    return [(parts, True) for parts in rejected] + [(parts, False) for parts in truncated]


async def throw_ucx(port: int, payloads: list[tuple[list[bytes], bool]], secret: bytes | None) -> None:
    from fabric.transport.ucx import UcxConnection, UcxTransport

    transport = UcxTransport(secret=secret)
    for parts, rejected in payloads:
        conn = await transport.connect("127.0.0.1", port)
        assert isinstance(conn, UcxConnection)
        try:
            await asyncio.wait_for(conn.post(parts), 5)
            while rejected:  # until the server has closed it (a Pong may come first)
                await asyncio.wait_for(conn.recv(), 10)  # a guard: TimeoutError fails the test
        except PeerDeadError:
            pass  # closed by the server, perhaps before the whole payload was sent
        finally:
            await conn.close()  # a truncated one: the sender leaves before the frame is whole


def test_ucx_ports_survive_garbage(hf_models: dict[str, Path], tmp_path: Path) -> None:
    pytest.importorskip("ucxx", reason="the [ucx] extra is part of the test install")
    with running_fabric(hf_models["qwen3_moe"], tmp_path, transport="ucx", aws=1, ews=2) as fabric:
        base, before, ports = serve_once_and_list_ports(fabric, 4)
        body = BODY
        payloads = ucx_payloads()
        for port in ports:
            asyncio.run(throw_ucx(port, payloads, fabric.supervisor.secret))
        assert all(proc.poll() is None for _, proc in fabric.procs), "a process died"
        status, after = post_json(base, body)
        assert status == 200 and after["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    closed = logs.count("closing connection from ucx://")
    rejected = sum(r for _, r in payloads)
    assert closed >= len(ports) * rejected, f"only {closed} bad UCX connections were logged and closed"
