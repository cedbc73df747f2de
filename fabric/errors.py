"""Typed errors. Each says whether the caller can recover from it.

A peer's death is an expected event (`PeerDeadError`, recoverable by rerouting or replaying). A malformed frame
closes one connection (`ProtocolError`, recoverable for the process). Bad configuration or an unreadable
checkpoint stops the process at start-up (`ConfigError`, `ModelFormatError`, fatal).
"""

from __future__ import annotations


class FabricError(Exception):
    """Base class. `recoverable` tells whether the process can keep serving after it."""

    recoverable: bool = False


class ConfigError(FabricError):
    """Invalid configuration or command-line flags."""


class ModelFormatError(FabricError):
    """A checkpoint directory that cannot be served (missing files, unsupported architecture)."""


class ProtocolError(FabricError):
    """A peer sent a malformed, truncated or oversized frame; only that connection is closed."""

    recoverable = True


class PeerDeadError(FabricError):
    """The connection to a peer closed or reset; in-flight calls to it must be rerouted."""

    recoverable = True

    def __init__(self, peer: str, reason: str = "connection closed") -> None:
        super().__init__(f"peer {peer} is dead: {reason}")
        self.peer = peer


class PeerSilentError(PeerDeadError):
    """The peer answered no probe for longer than its silence bound.

    It is hung, cut off, or very slow. This is a suspicion, as a stall is, since its connection did not end."""


class PeerStalledError(PeerDeadError):
    """The peer took no data, or gave no result, for the send deadline.

    It is a stuck reader on a live connection, or a slow one, and may still answer probes. The link is routed
    around like a dead one, and tried again. Whether the process is dead is the orchestrator's verdict."""


def connection_ended(exc: BaseException) -> bool:
    """Whether `exc` says a connection ended, by an EOF or a reset, the sign of an exit.

    It is false where the peer only went silent or took no data."""
    return isinstance(exc, PeerDeadError) and not isinstance(exc, PeerStalledError | PeerSilentError)


class RequestError(FabricError):
    """A single request cannot be served (bad parameters, too long); the request fails, not the process.

    `status` is the HTTP status its client gets: 400 for the request's own fault, 503 for a busy server."""

    recoverable = True

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class ExpertsUnavailableError(FabricError):
    """Every copy of a logical expert is gone and no replacement joined within the bound.

    The requests of that step end with an in-band error. The process keeps serving."""

    recoverable = True


class AuthError(ProtocolError):
    """A peer did not prove that it holds the cluster secret, or claimed an identity that is not its own.

    Its connection is closed before any message of it is read."""
