"""The Expert Routing Table (ERT): logical expert -> ordered list of physical replicas on EWs.

Owned by the orchestrator, versioned by `epoch`, pushed to every AW as a plain dict. The first
live replica of a list serves traffic; later entries are fallbacks (shadows, in the failure issue).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fabric.errors import ProtocolError


@dataclass(frozen=True)
class EwAddress:
    worker_id: str
    host: str
    port: int


@dataclass(frozen=True)
class RoutingTable:
    epoch: int
    num_layers: int
    num_experts: int
    replicas: dict[tuple[int, int], tuple[str, ...]]  # (layer, expert) -> EW ids, preferred first
    expert_workers: dict[str, EwAddress] = field(default_factory=dict)

    def primary(self, layer: int, expert: int, dead: frozenset[str] | set[str] = frozenset()) -> str | None:
        """First replica of (layer, expert) not in `dead`, or None if every copy is gone."""
        for ew in self.replicas.get((layer, expert), ()):
            if ew not in dead:
                return ew
        return None

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "replicas": [[lyr, e, list(ews)] for (lyr, e), ews in sorted(self.replicas.items())],
            "expert_workers": {w: {"host": a.host, "port": a.port} for w, a in sorted(self.expert_workers.items())},
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RoutingTable:
        try:
            replicas = {(int(lyr), int(e)): tuple(str(w) for w in ews) for lyr, e, ews in raw["replicas"]}
            workers = {
                str(w): EwAddress(str(w), str(a["host"]), int(a["port"])) for w, a in raw["expert_workers"].items()
            }
            return cls(int(raw["epoch"]), int(raw["num_layers"]), int(raw["num_experts"]), replicas, workers)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ProtocolError(f"malformed routing table: {exc}") from exc
