"""Optional TLS (fabric/tls.py): TCP links and HTTP servers encrypted with the cluster certificate;
a peer without TLS, or with another certificate, gets nowhere; a whole fabric serves over it."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from fabric.errors import ConfigError, PeerDeadError
from fabric.messages.liveness import Ping
from fabric.tls import Tls, write_self_signed
from fabric.transport import make_transport
from fabric.transport.base import Connection
from tests.conftest import running_fabric

SECRET = b"t" * 32


def test_tls_links(tmp_path: Path) -> None:
    tls, other = write_self_signed(tmp_path, days=2), write_self_signed(tmp_path, "other", days=2)

    async def main() -> None:
        async def echo(conn: Connection) -> None:
            while True:
                msg = await conn.recv()
                assert isinstance(msg, Ping)
                await conn.send(Ping(msg.nonce + 1))

        listener = await make_transport("tcp", secret=SECRET, tls=tls).listen("127.0.0.1", 0, echo)
        try:
            conn = await make_transport("tcp", secret=SECRET, tls=tls).connect("127.0.0.1", listener.port)
            await conn.send(Ping(1))
            reply = await asyncio.wait_for(conn.recv(), 30)
            assert isinstance(reply, Ping) and reply.nonce == 2
            await conn.close()
            with pytest.raises(PeerDeadError):  # no TLS: the handshake bytes are not a TLS hello
                await make_transport("tcp", secret=SECRET).connect("127.0.0.1", listener.port, timeout=10)
            with pytest.raises(PeerDeadError):  # another certificate: not the cluster's
                await make_transport("tcp", secret=SECRET, tls=other).connect("127.0.0.1", listener.port)
        finally:
            await listener.close()

    asyncio.run(main())
    with pytest.raises(ConfigError, match="UCX has no TLS"):
        make_transport("ucx", tls=tls)
    with pytest.raises(ConfigError, match="both"):
        Tls.of(tls.cert, None)
    with pytest.raises(ConfigError, match="cannot load"):
        Tls.of(tls.cert, other.key)  # a key that is not the certificate's


def test_a_fabric_over_tls(hf_models: dict[str, Path], tmp_path: Path) -> None:
    tls = write_self_signed(tmp_path, days=2)
    with running_fabric(hf_models["mixtral"], tmp_path, aws=1, ews=1, gateways=1, tls_cert=tls.cert,
                        tls_key=tls.key) as fabric:
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
        req = urllib.request.Request(f"https://127.0.0.1:{fabric.port}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60, context=tls.client) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):  # plain http: no answer
            urllib.request.urlopen(f"http://127.0.0.1:{fabric.port}/health", timeout=10)
        assert {w["role"] for w in fabric.cluster()["workers"]} >= {"attention", "expert", "gateway"}  # https admin
