"""A worker's control port, served on its control loop (fabric/control_plane.py).

It answers peers' probes whatever the data plane is doing, and takes what their control channel carries for the
role.

A peer opens one connection, says `Hello(its id, "control")`, then sends `Ping`s. Each is answered here with a
`Pong` that carries the role's load; an EW's says how many of the peer's calls it holds. Whatever else the role's
channel carries (from an EW's AWs, `AwActivity`) is handed to the service (`Service.control_message`, on the
control loop). The service gets None when the peer's connection ends.

Identity is bound to the connection. A second peer that claims a connected peer's id is refused
(`bound_elsewhere`), unless the first connection ends meanwhile, as when a peer reconnects.

It is always TCP, with the cluster secret and TLS where configured, whatever the data transport. Control
messages are small, and UCX is driven from the data plane's loop.
"""

from __future__ import annotations

from collections.abc import Callable

from fabric.errors import AuthError, ProtocolError
from fabric.messages.base import Message
from fabric.messages.liveness import Hello, Ping, Pong
from fabric.transport.base import Connection, Listener, Transport, bound_elsewhere

OnMessage = Callable[[str, Message | None], None]
# peer -> (how long the compute call under way has run, the peer's calls held)
Load = Callable[[str], tuple[float, int]]


class ControlPort:
    def __init__(self, transport: Transport, on_message: OnMessage, load: Load) -> None:
        self.transport = transport
        self.on_message = on_message  # raises ProtocolError for what the role does not take
        # What a Pong says besides its nonce. It is read from this thread, as a snapshot.
        self.load = load
        self.listener: Listener | None = None
        self.peers: dict[str, Connection] = {}

    async def listen(self, host: str, port: int = 0) -> int:
        self.listener = await self.transport.listen(host, port, self._serve)
        return self.listener.port

    async def _serve(self, conn: Connection) -> None:
        hello = await conn.recv()
        if not isinstance(hello, Hello) or hello.channel != "control":
            raise ProtocolError(f"expected a control hello, got {hello.kind}")
        peer = hello.aw_id
        if await bound_elsewhere(self.peers.get(peer), Pong(-1)):
            raise AuthError(f"{conn.peer} claims {peer}'s control channel, which is connected")
        self.on_message(peer, hello)  # the role may refuse a peer declared dead
        self.peers[peer] = conn
        try:
            while True:
                msg = await conn.recv()
                if isinstance(msg, Ping):
                    conn.send_nowait(Pong(msg.nonce, *self.load(peer)))
                elif isinstance(msg, Hello):
                    raise ProtocolError(f"{peer}: a second hello")
                else:
                    self.on_message(peer, msg)
        finally:
            if self.peers.get(peer) is conn:
                del self.peers[peer]
                self.on_message(peer, None)

    async def drop(self, peer: str) -> None:
        """Closes `peer`'s control connection. The peer was declared dead and is never served again."""
        conn = self.peers.pop(peer, None)
        if conn is not None:
            await conn.close()

    def abort(self) -> None:
        self.transport.abort_all()

    async def close(self) -> None:
        if self.listener is not None:
            await self.listener.close()
