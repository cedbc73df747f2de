"""The cluster secret and the handshake that proves a peer holds it.

Every internal connection begins with a mutual challenge-response over the cluster secret, before a single
message is read. That covers a worker's control link to the orchestrator, AW to EW, AW to store, and gateway to
AW. Sizes are fixed, so that nothing an unauthenticated peer sends is parsed:

    dialer  -> listener   MAGIC (8) | dialer nonce Nd (32)
    listener -> dialer    listener nonce Nl (32) | HMAC(K, "listener" | Nd | Nl) (32)
    dialer  -> listener   HMAC(K, "dialer" | Nl | Nd) (32)
    listener -> dialer    ACCEPT (1)

K = HMAC(secret, KEY_LABEL). Both sides use fresh nonces. A recorded handshake replayed to a listener fails, as
its nonce is new. A listener that does not hold the secret fails the dialer's check. Every MAC is compared in
constant time, and the whole exchange has a deadline. After it, messages flow as before, with no per-message
cost.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

from fabric.errors import AuthError, ConfigError

SECRET_ENV = "MOE_FABRIC_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16
MAGIC = b"MFAUTH1\0"
NONCE = 32
MAC = 32
ACCEPT = b"\x01"
KEY_LABEL = b"moe-fabric cluster handshake v1"
HANDSHAKE_TIMEOUT = 5.0  # seconds for the whole exchange
DIALER_HELLO = len(MAGIC) + NONCE
LISTENER_PROOF = NONCE + MAC

Read = Callable[[int], Awaitable[bytes | bytearray | memoryview]]
Write = Callable[[bytes], Awaitable[None]]


# -- the secret ------------------------------------------------------------------------------------
def create_secret_file(path: str | Path) -> bool:
    """Writes a fresh random secret to `path` (mode 0600) unless the file exists. True if it wrote."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    except OSError as exc:
        raise ConfigError(f"cannot create the cluster secret file {path}: {exc.strerror or exc}") from exc
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return True


def load_secret(path: str | None) -> bytes | None:
    """The cluster secret from `path`, else from $MOE_FABRIC_CLUSTER_SECRET, else None (no authentication).

    A file that others can read, or a secret shorter than MIN_SECRET_BYTES, is refused. The secret is every
    internal port's only key."""
    if path:
        p = Path(path)
        try:
            mode = p.stat().st_mode
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the cluster secret file {path}: {exc.strerror or exc}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"the cluster secret file {path} is readable by others (mode {stat.S_IMODE(mode):o}); "
                              f"chmod 600 it")
        value = text.strip()
        origin = path
    else:
        value = os.environ.get(SECRET_ENV, "").strip()
        origin = f"${SECRET_ENV}"
        if not value:
            return None
    if len(value.encode()) < MIN_SECRET_BYTES:
        raise ConfigError(f"the cluster secret in {origin} is shorter than {MIN_SECRET_BYTES} bytes")
    return value.encode()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def check_bind(host: str, secret: bytes | None, what: str) -> None:
    """Nothing listens beyond loopback without the cluster secret."""
    if secret is None and not is_loopback(host):
        raise ConfigError(f"{what} would listen on {host} with no cluster secret: anyone who can reach it would be "
                          f"trusted; pass --cluster-secret-file (or ${SECRET_ENV}), or listen on 127.0.0.1")


def bearer_ok(header: str | None, secret: bytes) -> bool:
    """`Authorization: Bearer <secret>`, compared in constant time."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), secret)


# -- the handshake ---------------------------------------------------------------------------------
def _key(secret: bytes) -> bytes:
    return hmac.new(secret, KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(key, label + a + b, hashlib.sha256).digest()


async def _read(read: Read, n: int) -> bytes:
    data = bytes(await read(n))
    if len(data) != n:
        raise AuthError(f"handshake: expected {n} bytes, got {len(data)}")
    return data


async def dialer_handshake(secret: bytes, read: Read, write: Write, peer: str) -> None:
    """The connecting side.

    Raises AuthError if the peer does not prove it holds the secret, or refuses this side's proof."""
    key = _key(secret)
    nd = secrets.token_bytes(NONCE)
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            await write(MAGIC + nd)
            reply = await _read(read, LISTENER_PROOF)
            nl, proof = reply[:NONCE], reply[NONCE:]
            if not hmac.compare_digest(proof, _mac(key, b"listener", nd, nl)):
                raise AuthError(f"{peer} does not hold the cluster secret")
            await write(_mac(key, b"dialer", nl, nd))
            if await _read(read, len(ACCEPT)) != ACCEPT:
                raise AuthError(f"{peer} refused this process's proof")
    except TimeoutError:
        raise AuthError(f"{peer}: handshake timed out") from None


async def listener_handshake(secret: bytes, read: Read, write: Write, peer: str) -> None:
    """The accepting side.

    Raises AuthError on anything but a dialer that proves it holds the secret. The caller closes the
    connection."""
    key = _key(secret)
    try:
        async with asyncio.timeout(HANDSHAKE_TIMEOUT):
            hello = await _read(read, DIALER_HELLO)
            if not hmac.compare_digest(hello[:len(MAGIC)], MAGIC):
                raise AuthError(f"{peer} did not start a moe-fabric handshake")
            nd = hello[len(MAGIC):]
            nl = secrets.token_bytes(NONCE)
            await write(nl + _mac(key, b"listener", nd, nl))
            proof = await _read(read, MAC)
            if not hmac.compare_digest(proof, _mac(key, b"dialer", nl, nd)):
                raise AuthError(f"{peer} does not hold the cluster secret")
            await write(ACCEPT)
    except TimeoutError:
        raise AuthError(f"{peer}: handshake timed out") from None
