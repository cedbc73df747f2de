"""Cluster views sent as differences.

The orchestrator broadcasts every change to every worker. At deployment scale a whole view is the routing
table's [L_moe, E, C] placement (48 KiB for a Qwen3-235B shape) plus every worker's record, times every link,
for each death. A delta carries what changed. A death's delta is one vacated slot, one address gone and one
worker's state: a few hundred bytes, whatever the cluster's size.

    diff(old, new)     the orchestrator: the delta from its previous broadcast to the next
    apply(view, d)     a worker: the next view, or None when `view` is not the delta's base
                       (it then asks for a whole view, `ViewRequest`)
"""

from __future__ import annotations

import numpy as np

from fabric.messages.control import ClusterView, TableDelta, ViewDelta
from fabric.routing import RoutingTable


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    return a is b or (a is not None and b is not None and a.shape == b.shape and bool(np.array_equal(a, b)))


def diff(old: ClusterView, new: ClusterView) -> ViewDelta | None:
    """The delta that turns `old` into `new`, or None where there is none to send.

    Another generation, or a table where there was none, goes whole."""
    if old.generation != new.generation or (new.table is not None and old.table is None) or \
            (new.table is None and old.table is not None) or not set(old.dead) <= set(new.dead):
        return None
    table = None
    t, o = new.table, old.table
    if t is not None and o is not None and t is not o:
        if (t.num_layers, t.num_experts, t.layers, t.generation) != (o.num_layers, o.num_experts, o.layers, o.generation):
            return None
        moved = t.slots != o.slots or not _same(t.placement, o.placement)
        changed = list(range(len(t.slots))) if moved else [i for i, (a, b) in enumerate(zip(t.occupants, o.occupants))
                                                              if a != b]
        was = set(o.addresses)
        now_ids = {a.worker_id for a in t.addresses}
        active_changed = not _same(t.active, o.active)
        table = TableDelta(t.epoch, changed, [t.occupants[i] for i in changed], [a for a in t.addresses if a not in was],
                           [a.worker_id for a in o.addresses if a.worker_id not in now_ids],
                           t.slots if moved else None, t.placement if moved else None,
                           t.active if active_changed else None, active_changed)
    before = {w.id: w for w in old.workers}
    now = {w.id for w in new.workers}
    was_dead = set(old.dead)
    return ViewDelta(new.generation, old.seq, new.seq, table, [w for w in new.workers if before.get(w.id) != w],
                     [w for w in before if w not in now], [w for w in new.dead if w not in was_dead])


def apply(view: ClusterView | None, d: ViewDelta) -> ClusterView | None:
    """`view` moved on by `d`, or None when `view` is not the view `d` was made from."""
    if view is None or view.generation != d.generation or view.seq != d.base:
        return None
    table = view.table
    if d.table is not None:
        if table is None:
            return None
        td = d.table
        moved = td.placement is not None and td.slots is not None
        slots, placement = (td.slots, td.placement) if td.placement is not None and td.slots is not None \
            else (table.slots, table.placement)
        occupants = [""] * len(slots) if moved else list(table.occupants)
        for i, occ in zip(td.changed, td.occupants):
            if not 0 <= i < len(occupants):
                return None
            occupants[i] = occ
        removed = set(td.removed)
        addresses = {a.worker_id: a for a in table.addresses if a.worker_id not in removed}
        addresses.update({a.worker_id: a for a in td.added})
        older = table
        table = RoutingTable(table.generation, td.epoch, table.num_layers, table.num_experts, table.layers, slots,
                             occupants, sorted(addresses.values(), key=lambda a: a.worker_id), placement,
                             td.active if td.active_changed else table.active)
        table.adopt_rows(older)
    changed = {w.id: w for w in d.workers}
    gone = set(d.gone)
    workers = [changed.pop(w.id, w) for w in view.workers if w.id not in gone] + list(changed.values())
    return ClusterView(d.generation, table, workers, sorted(set(view.dead) | set(d.dead)), d.seq)
