"""The Expert Routing Table (ERT): logical expert -> ordered list of physical replicas on EWs.

The orchestrator owns it, versions it by (generation, epoch), and pushes it to every worker as a record inside
`RoutingUpdate`. Placement is over *slots*, the EW ids of the first placement. The table says which live EW
occupies each slot. The placement tensor lists, for each logical expert, its slots in routing order: primary
first, then shadows. A logical expert's replicas are the live occupants of its slots, in that order. The first
not known dead serves traffic.

The placement travels as one int16 frame of `[L_moe, E, C]` slot indices, -1 meaning no copy. It is a numpy
array, as the orchestrator needs no torch. So a Qwen3-235B-sized table (94 x 128 x 2) is a 48 KiB frame rather
than a 1 MiB msgpack header.

Expert load balancing: `active` (`[L_moe, E]` int16; absent means 1 each) says how many of an expert's first
replicas serve traffic at once. An AW spreads a hot expert's rows over that many live replicas. The rest stay
inactive shadows.

Legend: L_moe MoE layers, E experts per layer, C copies per expert (1 + shadows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fabric.errors import ProtocolError

Unit = tuple[int, int]  # (layer, expert)


@dataclass(frozen=True)
class EwAddress:
    worker_id: str
    host: str
    port: int
    # Its gather policy waits for every active AW. Send it a call every layer, empty or not.
    sync: bool = True
    # Its control channel (probes, activity), served on its control loop.
    control_port: int = 0


@dataclass(frozen=True, eq=False)
class RoutingTable:
    # The orchestrator that published it. It is a fencing token: newer wins.
    generation: int
    # Increases with every table an orchestrator publishes, and across orchestrators.
    epoch: int
    num_layers: int
    num_experts: int
    layers: list[int]  # the MoE layers, in order
    slots: list[str]
    occupants: list[str]  # per slot: the live EW serving it, "" when vacant
    addresses: list[EwAddress]  # every live occupant
    placement: np.ndarray  # [L_moe, E, C] int16 slot indices, -1: none
    # [L_moe, E] int16, the replicas serving at once. None means 1 each.
    active: np.ndarray | None = None
    _rows: dict[int, list[list[int]]] = field(init=False, repr=False, compare=False)  # per MoE layer, on first use
    _layer_index: dict[int, int] = field(init=False, repr=False, compare=False)
    _by_id: dict[str, EwAddress] = field(init=False, repr=False, compare=False)
    _active: list[list[int]] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Checks the table is self-consistent, as a decoded one comes from the network."""
        p = self.placement
        if p.dtype != np.int16 or p.ndim != 3 or p.shape[0] != len(self.layers) or p.shape[1] != self.num_experts:
            raise ProtocolError(f"routing table: placement of shape {tuple(p.shape)} {p.dtype} does not fit "
                                f"{len(self.layers)} MoE layers x {self.num_experts} experts")
        if len(self.occupants) != len(self.slots) or len(set(self.slots)) != len(self.slots):
            raise ProtocolError("routing table: one occupant per distinct slot")
        if p.size and (int(p.min()) < -1 or int(p.max()) >= len(self.slots)):
            raise ProtocolError("routing table: placement names a slot that does not exist")
        if any(not 0 <= lyr < self.num_layers for lyr in self.layers) or len(set(self.layers)) != len(self.layers):
            raise ProtocolError("routing table: MoE layers out of range")
        a = self.active
        if a is not None and (a.dtype != np.int16 or tuple(a.shape) != tuple(p.shape[:2])
                              or (a.size and (int(a.min()) < 1 or int(a.max()) > max(1, p.shape[2])))):
            raise ProtocolError(f"routing table: active counts of shape {tuple(a.shape)} {a.dtype} do not fit the "
                                "placement (one count in 1..C per expert)")
        by_id = {a.worker_id: a for a in self.addresses}
        if any(o and o not in by_id for o in self.occupants):
            raise ProtocolError("routing table: an occupant without an address")
        object.__setattr__(self, "_rows", {})
        object.__setattr__(self, "_layer_index", {lyr: i for i, lyr in enumerate(self.layers)})
        object.__setattr__(self, "_by_id", by_id)
        object.__setattr__(self, "_active", a.tolist() if a is not None else None)

    def _row(self, i: int) -> list[list[int]]:
        """Layer index i's [E][C] slot indices, listed on first use.

        A table is built on every worker for every epoch. Listing a Qwen3-235B-sized placement whole took ~14 ms."""
        row = self._rows.get(i)
        if row is None:
            row = self._rows[i] = self.placement[i].tolist()
        return row

    def adopt_rows(self, older: RoutingTable) -> None:
        """Shares the listed rows of an older table with the same placement tensor.

        That is a new epoch that only changed occupants."""
        if older.placement is self.placement:
            object.__setattr__(self, "_rows", older._rows)

    @property
    def version(self) -> tuple[int, int]:
        """Tables are ordered by (generation, epoch), so a newer orchestrator's table always wins."""
        return self.generation, self.epoch

    @property
    def expert_workers(self) -> dict[str, EwAddress]:
        return self._by_id

    def replicas_of(self, layer: int, expert: int) -> tuple[str, ...]:
        i = self._layer_index.get(layer)
        if i is None or not 0 <= expert < self.num_experts:
            return ()
        return tuple(self.occupants[s] for s in self._row(i)[expert] if s >= 0 and self.occupants[s])

    def primary(self, layer: int, expert: int, dead: frozenset[str] | set[str] = frozenset()) -> str | None:
        """First live replica of (layer, expert) not in `dead`, or None if every copy is gone."""
        i = self._layer_index.get(layer)
        if i is None or not 0 <= expert < self.num_experts:
            return None
        for s in self._row(i)[expert]:
            if s >= 0:
                ew = self.occupants[s]
                if ew and ew not in dead:
                    return ew
        return None

    def serving(self, layer: int, expert: int, dead: frozenset[str] | set[str] = frozenset()) -> list[str]:
        """The live replicas that share (layer, expert)'s rows now.

        They are its first `active` replicas not in `dead`. When all of those are dead, it is the first live one
        after them, or [] if none is left."""
        i = self._layer_index.get(layer)
        if i is None or not 0 <= expert < self.num_experts:
            return []
        n = self._active[i][expert] if self._active is not None else 1
        ranks = [self.occupants[s] for s in self._row(i)[expert] if s >= 0]
        live = [ew for ew in ranks[:n] if ew and ew not in dead]
        if live:
            return live
        nxt = self.primary(layer, expert, dead)
        return [nxt] if nxt is not None else []

    def active_of(self, layer: int, expert: int) -> int:
        i = self._layer_index.get(layer)
        if i is None or self._active is None or not 0 <= expert < self.num_experts:
            return 1
        return self._active[i][expert]

    @property
    def replicas(self) -> dict[Unit, tuple[str, ...]]:
        return {(lyr, e): self.replicas_of(lyr, e) for lyr in self.layers for e in range(self.num_experts)}

    def placement_map(self) -> dict[Unit, list[str]]:
        """Every logical expert -> its slots in routing order (what a planner produced)."""
        return {(lyr, e): [self.slots[s] for s in self._row(i)[e] if s >= 0]
                for i, lyr in enumerate(self.layers) for e in range(self.num_experts)}

    def slot_units(self, slot: str) -> list[Unit]:
        """The (layer, expert) pairs placed on `slot`, any rank."""
        s = self.slots.index(slot)
        return [(lyr, e) for i, lyr in enumerate(self.layers) for e in range(self.num_experts) if s in self._row(i)[e]]

    def to_json(self) -> dict[str, Any]:
        return {
            "generation": self.generation,
            "epoch": self.epoch,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "slots": dict(zip(self.slots, self.occupants)),
            "replicas": [[lyr, e, list(ews)] for (lyr, e), ews in sorted(self.replicas.items())],
            "active": [[lyr, e, self.active_of(lyr, e)] for lyr in self.layers for e in range(self.num_experts)
                       if self.active_of(lyr, e) > 1],
            "expert_workers": {a.worker_id: {"host": a.host, "port": a.port}
                               for a in sorted(self.addresses, key=lambda a: a.worker_id)},
        }


def placement_tensor(layers: list[int], num_experts: int, slots: list[str],
                     placement: dict[Unit, list[str]]) -> np.ndarray:
    """A planner's unit -> slots map as the table's [L_moe, E, C] int16 tensor.

    It is built as lists. Element-wise tensor writes took ~50 ms for a Qwen3-235B shape, on every death."""
    copies = max((len(v) for v in placement.values()), default=1)
    index = {s: i for i, s in enumerate(slots)}
    pad = [-1] * copies
    rows = [[([index[s] for s in placement.get((lyr, e), [])] + pad)[:copies] for e in range(num_experts)]
            for lyr in layers]
    return np.array(rows, dtype=np.int16).reshape(len(layers), num_experts, copies)


def active_tensor(layers: list[int], num_experts: int, active: dict[Unit, int]) -> np.ndarray | None:
    """Units -> replicas serving at once, as the table's [L_moe, E] int16 tensor (None if all are 1)."""
    if not any(n > 1 for n in active.values()):
        return None
    t = np.ones((len(layers), num_experts), dtype=np.int16)
    index = {lyr: i for i, lyr in enumerate(layers)}
    for (lyr, e), n in active.items():
        if lyr in index and 0 <= e < num_experts:
            t[index[lyr], e] = n
    return t
