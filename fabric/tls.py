"""Optional TLS for TCP links and the HTTP servers (the `ssl` module).

One cluster certificate and key (`--tls-cert`, `--tls-key`) are the same on every process. A listener presents
the certificate, and a dialer accepts only a peer that presents it. The certificate is its own trust anchor.
Host names are not checked, as peers are named by address and proven by the cluster handshake, which runs inside
TLS. TLS adds what the handshake does not: the bytes on the wire are encrypted. UCX has no TLS, so
`--transport ucx` with TLS is refused.

A self-signed cluster certificate:

    openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj /CN=moe-fabric \\
        -keyout cluster.key -out cluster.crt && chmod 600 cluster.key
"""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fabric.errors import ConfigError


@dataclass(frozen=True)
class Tls:
    cert: str
    key: str

    @staticmethod
    def of(cert: str | None, key: str | None) -> Tls | None:
        if (cert is None) != (key is None):
            raise ConfigError("TLS needs both --tls-cert and --tls-key")
        if cert is None or key is None:
            return None
        tls = Tls(cert, key)
        # Unreadable files or a key that does not match are refused at start-up.
        _ = tls.server
        return tls

    @cached_property
    def server(self) -> ssl.SSLContext:
        """The listening side's context (built once)."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the TLS certificate {self.cert} and key {self.key}: {exc}") from exc
        return ctx

    @cached_property
    def client(self) -> ssl.SSLContext:
        """The dialing side's context (built once)."""
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.cert)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # Peers are dialled by address. The certificate must still verify.
        ctx.check_hostname = False
        return ctx


def write_self_signed(out: Path, name: str = "cluster", days: int = 365) -> Tls:
    """Writes a self-signed cluster certificate and key in `out`, for tests, benchmarks and a first try.

    It runs openssl, as the module docstring shows."""
    cert, key = out / f"{name}.crt", out / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", str(days),
                    "-subj", "/CN=moe-fabric", "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    key.chmod(0o600)
    return Tls(str(cert), str(key))
