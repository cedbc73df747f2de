"""Expert load balancing (EPLB).

It finds which experts are hot, from the EWs' per-expert token counts, and decides how many of
their replicas serve at once.

Every EW reports its cumulative rows per (layer, expert) in its stats. Each round the balancer
takes the rows since the last round and, per MoE layer, evens the EWs' load. That is EPLB's goal,
as a layer's step waits for its busiest EW. While the busiest EW serves more than `hot_factor`
times the mean, its hottest expert gets another active replica. That is a copy on an EW that was
not serving it, so its rows are spread. Where every copy of it serves already, a new copy is made
on the least loaded EW (spare capacity), then made active. Experts go back to one replica once
they are not needed for that.

Activating a copy moves no byte. A new copy is mapped from the weight store. A change is published
as a new routing table, which AWs apply between steps. A recovered or replaced EW's copies join the
same way, so the load is rebalanced after a recovery too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from fabric.messages.control import Role
from orchestrator.effects import Publish

if TYPE_CHECKING:
    from orchestrator.main import Orchestrator

log = logging.getLogger("orchestrator")

Unit = tuple[int, int]


async def balance_loop(orch: Orchestrator) -> None:
    """Runs a balancing round every `balance_interval_s`.

    A round takes the rows since the last round and the balancer's verdict. It adds at most one new
    copy, loaded before it is published, and publishes a new table if what serves changed."""
    balancer = ExpertBalancer(orch.cfg.hot_expert_factor)
    while True:
        await asyncio.sleep(orch.cfg.balance_interval_s)
        c = orch.cluster
        if c.table is None or c.placement is None or not orch.recovered.is_set() or orch.shutting_down:
            continue
        counts = {w.id: {(lyr, e): n for lyr, e, n in w.stats.tokens_by_expert}
                  for w in c.workers.values() if w.role is Role.EXPERT and w.serving}
        rows = balancer.rows_since_last(counts)
        active = balancer.decide(rows, {u: list(ews) for u, ews in c.table.replicas.items() if ews}, c.active)
        for unit, ew in balancer.grow[:1]:
            if await orch.scaler.add_copy(unit, ew):
                active[unit] = len(c.placement[unit])
                log.info("expert load balancing: a copy of layer %d expert %d added on %s (%d copies)", *unit, ew,
                         active[unit])
        if active != c.active:
            hot, cooled = sorted(set(active) - set(c.active)), sorted(set(c.active) - set(active))
            c.active = active
            c.publish()
            assert c.table is not None
            log.info("expert load balancing: epoch %d, %d experts spread over their replicas (now hot: %s; "
                     "cooled: %s)", c.table.epoch, len(active), hot[:8], cooled[:8])
            orch.apply(Publish())


class ExpertBalancer:
    def __init__(self, hot_factor: float = 1.5, min_rows: int = 64) -> None:
        if hot_factor < 1.0:
            raise ValueError("hot_factor must be >= 1")
        self.hot_factor = hot_factor
        # Rows a layer needs in a round before it is judged; fewer are noise.
        self.min_rows = min_rows
        self._last: dict[str, dict[Unit, int]] = {}  # EW -> its cumulative counts at the last round
        self.load: dict[Unit, int] = {}  # rows per unit in the last round
        # (unit, EW) pairs of the last round. The unit is a hot one whose every copy serves, on an
        # overloaded EW. The EW is the least loaded one without a copy. The orchestrator adds that
        # copy (ReMP/EPLB's replication onto spare capacity), then makes it active.
        self.grow: list[tuple[Unit, str]] = []

    def rows_since_last(self, counts_by_ew: dict[str, dict[Unit, int]]) -> dict[Unit, int]:
        """Rows per unit since the last round, summed over the EWs.

        It works from each EW's cumulative rows per unit. A restarted EW starts at 0."""
        out: dict[Unit, int] = {}
        for ew, counts in counts_by_ew.items():
            # First seen, or this orchestrator is new. Its counts so far are no round.
            if ew not in self._last:
                self._last[ew] = dict(counts)
                continue
            last = self._last[ew]
            for unit, n in counts.items():
                delta = n - last.get(unit, 0)
                if delta < 0:
                    delta = n
                if delta:
                    out[unit] = out.get(unit, 0) + delta
            self._last[ew] = dict(counts)
        for ew in list(self._last):
            if ew not in counts_by_ew:
                del self._last[ew]
        return out

    def decide(self, rows: dict[Unit, int], replicas: dict[Unit, list[str]], current: dict[Unit, int]) -> dict[Unit, int]:
        """The active replica count of every unit whose count is not 1.

        It is decided from this round's rows and each unit's live replicas, primary first. Per MoE
        layer, the goal is even EW load. That is EPLB's goal, as a layer's step waits for its
        busiest EW. An EW's load is the rows of the layer's units it serves, a unit's rows shared
        evenly by its active replicas.

        While the busiest EW carries more than `hot_factor` times the mean, the unit it serves with
        the most rows per replica gets one more active replica, one not serving it yet. Where every
        copy serves already, `grow` names a new copy to make. Units made active earlier go back to
        one replica if the busiest EW stays under the midpoint of 1 and `hot_factor` without them.
        A layer with too few rows this round keeps what it had."""
        self.load = rows
        self.grow = []
        by_layer: dict[int, list[Unit]] = {}
        for u in replicas:
            by_layer.setdefault(u[0], []).append(u)
        ews = sorted({w for rs in replicas.values() for w in rs})
        out: dict[Unit, int] = {}
        for units in by_layer.values():
            keep = {u: min(current[u], len(replicas[u])) for u in units if current.get(u, 1) > 1}
            if sum(rows.get(u, 0) for u in units) < self.min_rows or len(ews) < 2:
                out.update(keep)
            else:
                out.update(self._layer(units, rows, replicas, keep, ews))
        return {u: n for u, n in out.items() if n > 1}

    def _layer(self, units: list[Unit], rows: dict[Unit, int], replicas: dict[Unit, list[str]],
               active: dict[Unit, int], ews: list[str]) -> dict[Unit, int]:
        def loads(act: dict[Unit, int]) -> dict[str, float]:
            out = dict.fromkeys(ews, 0.0)
            for u in units:
                n = act.get(u, 1)
                for w in replicas[u][:n]:
                    out[w] += rows.get(u, 0) / n
            return out

        def peak(act: dict[Unit, int]) -> float:
            ld = loads(act)
            return max(ld.values()) / max(1e-9, sum(ld.values()) / len(ld))

        cool = (1.0 + self.hot_factor) / 2
        for u in sorted(active, key=lambda u: rows.get(u, 0)):  # the coolest first
            trial = {k: v for k, v in active.items() if k != u}
            if peak(trial) <= cool:
                active = trial
        for _ in range(4 * len(units)):
            ld = loads(active)
            mean = sum(ld.values()) / len(ld)
            busiest = max(ews, key=lambda w: ld[w])
            if ld[busiest] <= self.hot_factor * mean:
                break
            candidates = [u for u in units if busiest in replicas[u][:active.get(u, 1)]
                          and len(replicas[u]) > active.get(u, 1) and rows.get(u, 0)]
            # Every copy of its hot units serves, so one more copy goes on spare capacity.
            if not candidates:
                served = [u for u in units if busiest in replicas[u][:active.get(u, 1)] and rows.get(u, 0)]
                if served:
                    hot = max(served, key=lambda u: rows.get(u, 0) / active.get(u, 1))
                    spare = [w for w in ews if w not in replicas[hot]]
                    if spare:
                        self.grow.append((hot, min(spare, key=lambda w: ld[w])))
                break
            u = max(candidates, key=lambda u: rows.get(u, 0) / active.get(u, 1))
            active = {**active, u: active.get(u, 1) + 1}
        return active
