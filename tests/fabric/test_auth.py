"""The cluster handshake (fabric/auth.py) on every transport (tcp, its same-host sockets, ucx): a peer without the secret, with a
wrong one, or replaying a recorded handshake is refused before any message of it is read, and the
listener keeps serving the peers that prove themselves."""

from __future__ import annotations

import asyncio
from importlib.util import find_spec
from pathlib import Path

import pytest

from fabric import auth
from fabric.errors import AuthError, ConfigError, PeerDeadError
from fabric.messages.liveness import Ping
from fabric.transport import make_transport
from fabric.transport.base import Connection
from tests.helpers import dialer, fabric_transport, replay_handshake, same_host_on

TRANSPORTS = ["tcp", "unix",
              pytest.param("ucx", marks=pytest.mark.skipif(find_spec("ucxx") is None, reason="needs the [ucx] extra"))]
SECRET = b"s" * 32
OTHER = b"o" * 32


class Echo:
    """A listener's handler that counts the messages it read and answers each Ping."""

    def __init__(self) -> None:
        self.read = 0

    async def __call__(self, conn: Connection) -> None:
        while True:
            msg = await conn.recv()
            self.read += 1
            if isinstance(msg, Ping):
                await conn.send(Ping(msg.nonce + 1))


async def ping(conn: Connection, nonce: int) -> int:
    await conn.send(Ping(nonce))
    reply = await asyncio.wait_for(conn.recv(), 30)
    assert isinstance(reply, Ping)
    return reply.nonce


@pytest.mark.parametrize("name", TRANSPORTS)
def test_only_peers_with_the_secret_get_in(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    same_host_on(name, monkeypatch)

    async def main() -> None:
        echo = Echo()
        server = make_transport(fabric_transport(name), secret=SECRET)
        listener = await server.listen("127.0.0.1", 0, echo)
        try:
            # The right secret: messages flow both ways.
            good = await dialer(name, SECRET).connect("127.0.0.1", listener.port)
            assert await ping(good, 1) == 2

            # A wrong secret: the dialer finds the listener does not prove the secret it holds.
            with pytest.raises(PeerDeadError, match="authentication failed"):
                await dialer(name, OTHER).connect("127.0.0.1", listener.port)

            # No handshake at all: a message is sent straight away; the listener reads it as a
            # handshake, refuses it, and closes; the handler never sees a message.
            bare = await dialer(name).connect("127.0.0.1", listener.port)
            await bare.send(Ping(7))
            with pytest.raises(PeerDeadError):
                await asyncio.wait_for(bare.recv(), 30)
            await bare.close()

            # A replayed handshake: a real dialer's recorded bytes played to a new connection.
            await replay_handshake(name, listener.port, SECRET)

            # The listener saw no message from any refused peer, and still serves.
            assert echo.read == 1
            assert await ping(good, 10) == 11
            again = await dialer(name, SECRET).connect("127.0.0.1", listener.port)
            assert await ping(again, 20) == 21
            await again.close()
            await good.close()
        finally:
            await listener.close()

    asyncio.run(main())


@pytest.mark.parametrize("name", TRANSPORTS)
def test_a_listener_without_the_secret_is_not_trusted(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutual: a dialer with the secret refuses a listener that cannot prove it (an impostor)."""
    same_host_on(name, monkeypatch)

    async def main() -> None:
        echo = Echo()
        listener = await make_transport(fabric_transport(name)).listen("127.0.0.1", 0, echo)
        try:
            with pytest.raises(PeerDeadError):
                await dialer(name, SECRET).connect("127.0.0.1", listener.port, timeout=10)
        finally:
            await listener.close()
        assert echo.read == 0

    asyncio.run(main())


def test_a_silent_dialer_is_cut_off_at_the_handshake_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "HANDSHAKE_TIMEOUT", 0.3)

    async def main() -> None:
        refused: list[BaseException] = []

        async def read(n: int) -> bytes:
            await asyncio.sleep(3600)
            return b""

        async def write(data: bytes) -> None:
            pass

        try:
            await auth.listener_handshake(SECRET, read, write, "silent")
        except AuthError as exc:
            refused.append(exc)
        assert refused and "timed out" in str(refused[0])

    asyncio.run(main())


def test_secret_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "secret"
    assert auth.create_secret_file(path) and not auth.create_secret_file(path)  # created once, never overwritten
    assert path.stat().st_mode & 0o777 == 0o600
    secret = auth.load_secret(str(path))
    assert secret is not None and len(secret) == 64
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        auth.load_secret(str(path))
    short = tmp_path / "short"
    short.write_text("abc")
    short.chmod(0o600)
    with pytest.raises(ConfigError, match="shorter"):
        auth.load_secret(str(short))
    with pytest.raises(ConfigError, match="cannot read"):
        auth.load_secret(str(tmp_path / "missing"))
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    assert auth.load_secret(None) is None
    monkeypatch.setenv(auth.SECRET_ENV, "e" * 20)
    assert auth.load_secret(None) == b"e" * 20


def test_cluster_secret_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from launch.cli import main

    path = tmp_path / "s"
    assert main(["cluster-secret", str(path)]) == 0 and path.stat().st_mode & 0o777 == 0o600
    first = path.read_text()
    assert main(["cluster-secret", str(path)]) == 2 and path.read_text() == first  # never overwritten
    assert "not overwritten" in capsys.readouterr().err
    assert main(["cluster-secret", str(tmp_path / "no" / "dir")]) == 2


def test_no_listening_beyond_loopback_without_a_secret() -> None:
    auth.check_bind("127.0.0.1", None, "x")
    auth.check_bind("::1", None, "x")
    auth.check_bind("0.0.0.0", SECRET, "x")
    for host in ("0.0.0.0", "10.1.2.3", "myhost"):
        with pytest.raises(ConfigError, match="no cluster secret"):
            auth.check_bind(host, None, "x")


def test_bearer() -> None:
    assert auth.bearer_ok(f"Bearer {SECRET.decode()}", SECRET)
    assert not auth.bearer_ok(f"Bearer {OTHER.decode()}", SECRET)
    assert not auth.bearer_ok(None, SECRET) and not auth.bearer_ok(SECRET.decode(), SECRET)
