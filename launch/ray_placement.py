"""Where `serve --cluster ray` puts each fabric process: Ray nodes are the failure domains.

Attention workers go over as many nodes as can take them. The checkpoint store goes away from the
attention workers it protects. Expert workers go over the nodes; the orchestrator puts each
expert's shadows on other nodes than its primary. Gateways go apart. `spread_notes` names the
guarantees a too-small cluster cannot give.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from fabric.messages.control import Role


@dataclass
class NodeState:
    """A Ray node as placement sees it: its resources, and what the fabric placed there."""

    node_id: str
    total: dict[str, float]
    used: dict[str, float] = field(default_factory=dict)
    roles: Counter[Role] = field(default_factory=Counter)

    def fits(self, res: dict[str, float]) -> bool:
        return all(self.total.get(k, 0.0) - self.used.get(k, 0.0) >= v - 1e-9 for k, v in res.items())

    def take(self, role: Role, res: dict[str, float], sign: int = 1) -> None:
        for k, v in res.items():
            self.used[k] = self.used.get(k, 0.0) + sign * v
        self.roles[role] += sign


def choose_node(role: Role, res: dict[str, float], nodes: list[NodeState], avoid: set[str] = frozenset()  # type: ignore[assignment]
                ) -> NodeState | None:
    """The node for a new process of `role`.

    It fits `res`, and is not in `avoid` if possible. Among those nodes it is the one that keeps
    failure domains apart (see the module doc)."""
    fit = [n for n in nodes if n.fits(res)]
    preferred = [n for n in fit if n.node_id not in avoid] or fit
    if not preferred:
        return None

    def key(n: NodeState) -> tuple[int, ...]:
        if role in (Role.ATTENTION, Role.STORE):  # AWs apart, and the store away from them
            return n.roles[Role.ATTENTION], n.roles[Role.STORE], sum(n.roles.values())
        return n.roles[role], 0, sum(n.roles.values())

    return min(preferred, key=key)


def spread_notes(nodes: list[NodeState], expert_workers: int) -> list[str]:
    """The failure-domain guarantees this placement does not give."""
    notes = []
    aws = [n for n in nodes if n.roles[Role.ATTENTION]]
    stores = [n for n in nodes if n.roles[Role.STORE]]
    ews = [n for n in nodes if n.roles[Role.EXPERT]]
    if sum(n.roles[Role.ATTENTION] for n in nodes) > 1 and len(aws) == 1:
        notes.append("every attention worker is on one node: its death pauses serving until replacements load")
    if stores and all(n.roles[Role.ATTENTION] for n in stores):
        notes.append("every checkpoint store shares a node with attention workers: that node's death loses those "
                     "AWs' checkpoints (their streams resume by replay)")
    if expert_workers > 1 and len(ews) == 1:
        notes.append("every expert worker is on one node: its death loses every copy of every expert until "
                     "replacements load")
    return notes
