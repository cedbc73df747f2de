"""Worker <-> orchestrator channel (a websocket on the orchestrator's HTTP port).

The control plane's state is typed: roles and worker states are enums, a worker is a
`WorkerInfo`, and what the orchestrator publishes is a `ClusterView` (the routing table, the
workers, the dead). Every worker keeps the last view it received and hands it back when it
registers again, which is how a restarted orchestrator rebuilds the cluster (see
`orchestrator/recovery.py`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fabric.messages.base import Message, register
from fabric.routing import EwAddress, RoutingTable


class Role(enum.StrEnum):
    ORCHESTRATOR = "orchestrator"
    ATTENTION = "attention"
    EXPERT = "expert"
    STORE = "checkpoint_store"
    GATEWAY = "gateway"
    WEIGHT_STORE = "weight_store"  # a host's weight store: started by `serve`, never registers

    @property
    def prefix(self) -> str:
        """Worker ids are `<prefix>-<n>`."""
        return {"orchestrator": "orch", "attention": "aw", "expert": "ew", "checkpoint_store": "cs",
                "gateway": "gw", "weight_store": "wst"}[self.value]

    @property
    def replaceable(self) -> bool:
        """Roles whose dead workers the orchestrator replaces (gateways: their supervisor restarts them)."""
        return self in (Role.ATTENTION, Role.EXPERT, Role.STORE)


class WorkerState(enum.StrEnum):
    STARTING = "starting"  # registered, not serving yet (loading weights, connecting)
    ALIVE = "alive"
    UNREACHABLE = "unreachable"  # its orchestrator link dropped: still serving, expected to rejoin
    DEAD = "dead"  # for good: fenced, never used again


class Origin(enum.StrEnum):
    """Why a worker exists."""

    INITIAL = "initial"  # started with the fabric
    REPLACEMENT = "replacement"  # started (or woken, or given a vacant slot) in place of a dead worker
    SCALE_OUT = "scale-out"  # started by a scale operation: never a spare for a vacant slot


@dataclass
class Life:
    """Why a worker exists and where it stands in its life, beside its `WorkerState`. A worker
    says what it knows when it registers; the orchestrator completes it (a replacement it started,
    a standby it woke, a spare it gave a slot)."""

    origin: Origin = Origin.INITIAL
    replaces: str = ""  # REPLACEMENT: the dead worker it stands in for
    standby: bool = False  # a warm spare: serves nothing until woken (AW) or given a slot (EW)

    def __post_init__(self) -> None:
        _short(self.replaces)

    def woken(self, replaces: str) -> None:
        """A standby now serves in place of `replaces`."""
        self.origin, self.replaces, self.standby = Origin.REPLACEMENT, replaces, False


@dataclass
class Traits:
    """What a worker says about itself when it registers. Placement reads `node` (copies of a
    unit go to different machines) and the routing table `gather`; the rest is shown in /cluster."""

    node: str = ""  # the machine (or Ray node) it runs on
    transport: str = ""
    gather: str = ""  # EW: "sync" (a layer's calls from every AW answered together) or "async"
    model: str = ""  # gateway: the model name it serves
    kv_blocks: int = 0  # AW
    block_size: int = 0  # AW
    bucket_mib: int = 0  # checkpoint store
    warmup_ms: float = 0.0  # AW, EW: the warm-up before it served (0: none)

    def __post_init__(self) -> None:
        _short(self.node, self.transport, self.gather, self.model)


MAX_NAME = 256  # characters in a name a worker reports (/cluster shows it, every later view carries some)


def _short(*names: str) -> None:
    if any(len(n) > MAX_NAME for n in names):
        raise ValueError(f"a name over {MAX_NAME} characters")


@dataclass(frozen=True)
class WorkerInfo:
    id: str
    role: Role
    host: str
    port: int
    state: WorkerState
    pid: int = 0
    control_port: int = 0  # where peers probe it, on its control loop (0: none)

    @property
    def serving(self) -> bool:
        """Usable by peers: alive, or alive when last heard of (its orchestrator link is down)."""
        return self.state in (WorkerState.ALIVE, WorkerState.UNREACHABLE)


@dataclass(frozen=True, eq=False)
class ClusterView:
    """What the orchestrator publishes: the routing table (None before the first placement), every
    worker not dead, and the dead (peers fence them off; EWs stop waiting for them)."""

    generation: int
    table: RoutingTable | None
    workers: list[WorkerInfo]
    dead: list[str]
    seq: int = 0  # the orchestrator's broadcast number (a `ViewDelta` names the one it applies to)

    def serving(self, role: Role) -> list[WorkerInfo]:
        return [w for w in self.workers if w.role is role and w.serving]

    @property
    def version(self) -> tuple[int, int, int]:
        """Views are ordered by (generation, epoch, seq): a worker's death changes no epoch but is
        a newer view all the same (a restarted orchestrator must rebuild from the newest)."""
        return self.generation, self.table.epoch if self.table else 0, self.seq


@register
@dataclass
class Register(Message):
    """First message on a worker's link. A worker that has registered before (with this or an
    earlier orchestrator) gives its id, the newest generation it has seen and its last view, so a
    restarted orchestrator can rebuild the cluster from what the workers report."""

    kind = "register"
    role: Role
    pid: int
    host: str
    port: int  # the worker's listening port (the gateway's HTTP port)
    worker_id: str = ""  # "" for a new worker
    generation_seen: int = 0
    view: ClusterView | None = None
    slot: str = ""  # EW: the placement slot it holds ("" none)
    experts: list[list[int]] = field(default_factory=list)  # EW: the (layer, expert) pairs it has loaded
    ready: bool = False  # serving (EW: experts loaded; AW: connected to the EWs of a table)
    life: Life = field(default_factory=Life)
    traits: Traits = field(default_factory=Traits)
    view_version: list[int] = field(default_factory=list)  # instead of `view`: its (generation, epoch, seq)
    control_port: int = 0  # where peers probe it (fabric/control_port.py; 0: none)
    # Who its process is on its machine (fabric/local_process.py): an orchestrator on the same machine watches its run
    # queue waits; "" where it cannot say.
    proc: str = ""


@register
@dataclass
class Registered(Message):
    kind = "registered"
    worker_id: str
    generation: int  # this orchestrator's fencing token: a worker follows no older one
    send_view: bool = False  # your view is newer than any this orchestrator holds: send it (`ViewReport`)
    heartbeat_ms: float = 0.0  # send a `Heartbeat` this often (0: never); a worker silent for a lease is dead


@register
@dataclass
class Heartbeat(Message):
    """Worker -> orchestrator, every `Registered.heartbeat_ms`: this worker's loop runs (its lease:
    orchestrator/verdicts.py). Sent from the event loop, which never waits on compute."""

    kind = "heartbeat"


@register
@dataclass
class ViewReport(Message):
    """Worker -> a (re)started orchestrator that asked for it: the newest view this worker holds.
    Registrations carry only the view's version, so that a restarted orchestrator decodes one
    whole view (or a few) rather than one per worker: 256 of them took ~0.5 s of its CPU."""

    kind = "view_report"
    view: ClusterView


@register
@dataclass
class Fenced(Message):
    """Orchestrator -> worker: you were declared dead (a hung process that woke up, or one the
    orchestrator gave up on); leave now. Peers have stopped using you."""

    kind = "fenced"
    reason: str


@register
@dataclass
class Leaving(Message):
    """Worker -> orchestrator: this worker is shutting down on purpose (declare it dead at once)."""

    kind = "leaving"
    reason: str


@register
@dataclass
class AssignExperts(Message):
    """Orchestrator -> EW: load these (layer, expert) FFNs, which make up placement slot `slot`."""

    kind = "assign_experts"
    slot: str
    experts: list[list[int]]
    op: int = 0  # echoed in the WorkerReady that says these are loaded (a scale waits for its own)


@register
@dataclass
class Drain(Message):
    """Orchestrator -> worker: leave now, as on SIGTERM (scaled in); nobody replaces you."""

    kind = "drain"
    reason: str


@register
@dataclass
class Wake(Message):
    """Orchestrator -> a standby AW: map your weights and serve (a worker died; you take its place)."""

    kind = "wake"
    replaces: str


@register
@dataclass
class WorkerReady(Message):
    """Worker -> orchestrator: weights loaded and (for AWs) connected to every EW in the table."""

    kind = "worker_ready"
    epoch: int
    op: int = 0  # an EW: the AssignExperts it finished (its `op`)


@register
@dataclass
class RoutingUpdate(Message):
    """Orchestrator -> every worker: the newest cluster view."""

    kind = "routing_update"
    view: ClusterView


@dataclass(frozen=True)
class TableDelta:
    """What changed in the routing table: the slots whose occupant changed and the addresses that
    came and went (a death: one of each, whatever the cluster's size), and the [L_moe, E, C]
    placement or the active counts only when they changed (a scale, a balancing step)."""

    epoch: int
    changed: list[int]  # slot indices whose occupant changed (every slot with a new placement)...
    occupants: list[str]  # ...and their occupants now ("" vacant)
    added: list[EwAddress]  # addresses new (or changed) in this table
    removed: list[str]  # EWs no longer addressed
    slots: list[str] | None = None  # with `placement`: a new placement (None: unchanged)
    placement: np.ndarray | None = None
    active: np.ndarray | None = None
    active_changed: bool = False


@register
@dataclass
class ViewDelta(Message):
    """Orchestrator -> a worker that holds view `base` (the previous broadcast): the next view, as
    its differences (fabric/view_delta.py). A worker without that view asks for a whole one."""

    kind = "view_delta"
    generation: int
    base: int
    seq: int
    table: TableDelta | None  # None: the same table
    workers: list[WorkerInfo]  # new or changed
    gone: list[str]  # no longer listed
    dead: list[str]  # newly declared dead


@register
@dataclass
class ViewRequest(Message):
    """Worker -> orchestrator: a delta did not apply to my view; send me a whole one."""

    kind = "view_request"


@register
@dataclass
class WorkerStats(Message):
    """Worker -> orchestrator, every few seconds: the load figures decisions read, typed, and a
    report that /cluster shows and nothing decides on."""

    kind = "worker_stats"
    report: dict[str, Any] = field(default_factory=dict)
    outstanding_work: int = 0  # AW: tokens still to prefill and decode (scale-in drains the least busy)
    tokens_by_expert: list[list[int]] = field(default_factory=list)  # EW: [layer, expert, rows so far] (balancing)


@register
@dataclass
class PeerFailed(Message):
    """Worker -> orchestrator: this worker cannot reach `worker_id` (its connection ended, it went
    silent, it took no data) and routes around it. A suspicion: the orchestrator decides on
    evidence (orchestrator/verdicts.py) whether it is dead, then fences it and publishes the next
    epoch."""

    kind = "peer_failed"
    worker_id: str
    reason: str
    closed: bool = False  # the reporter saw its connection to the worker end (an EOF, a reset), not a silence


@register
@dataclass
class PeerAlive(Message):
    """Orchestrator -> the workers that sent `PeerFailed`: `worker_id` answers the orchestrator, so
    it is not dead. Whether a reporter uses it again is up to its own probes of its own link."""

    kind = "peer_alive"
    worker_id: str


@register
@dataclass
class LinkProbe(Message):
    """Orchestrator -> worker: are you there? Answered by the worker's link reader at once."""

    kind = "link_probe"
    nonce: int


@register
@dataclass
class LinkProbeReply(Message):
    kind = "link_probe_reply"
    nonce: int
