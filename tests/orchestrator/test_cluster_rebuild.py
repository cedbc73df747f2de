"""The orchestrator's state, rebuilt by a new orchestrator from what the workers of an earlier one
report: their ids, slots and experts, and the newest view they saw. Pure (no processes)."""

from __future__ import annotations

from pathlib import Path

from fabric.messages.control import ClusterView, Register, Role, WorkerState
from fabric.model.config import ModelConfig
from orchestrator.cluster import Cluster
from orchestrator.placement import BalancedPlanner


def _cluster(model: Path, generation: int) -> Cluster:
    return Cluster(ModelConfig.from_dir(model), 3, BalancedPlanner(1), "127.0.0.1", 7000, generation)


def _reg(role: Role, wid: str = "", view: ClusterView | None = None, gen: int = 0, **kw: object) -> Register:
    return Register(role, 100, "127.0.0.1", 9000, wid, gen, view, **kw)  # type: ignore[arg-type]


def _running(model: Path) -> tuple[Cluster, ClusterView]:
    """An earlier orchestrator's cluster: 3 EWs placed and ready, 2 AWs, a store, a gateway."""
    old = _cluster(model, 1)
    for role in (Role.EXPERT, Role.EXPERT, Role.EXPERT, Role.ATTENTION, Role.ATTENTION, Role.STORE, Role.GATEWAY):
        assert old.add(_reg(role)) is not None
    for ew in old.maybe_place():
        old.mark_ready(ew)
    old.mark_ready("aw-0")
    old.mark_ready("aw-1")
    assert old.table is not None and old.table.epoch == 1
    old.mark_dead("aw-1")  # it died earlier: fenced
    return old, old.view()


def test_rebuild_from_the_workers_reports(hf_models: dict[str, Path]) -> None:
    old, view = _running(hf_models["mixtral"])
    new = _cluster(hf_models["mixtral"], 2)
    # Every worker registers again with its id and the view, except ew-1 and aw-0 (they died meanwhile).
    for w in old.workers.values():
        if w.id in ("ew-1", "aw-0", "aw-1"):
            continue
        reg = _reg(w.role, w.id, view, 1, slot=w.slot, experts=[list(u) for u in w.experts], ready=True)
        rec = new.add(reg)
        assert rec is not None and rec.id == w.id and rec.state is WorkerState.ALIVE
    replace = new.rebuild(view)
    assert sorted(replace) == [(Role.ATTENTION, "aw-0"), (Role.EXPERT, "ew-1")]
    assert new.table is not None and new.table.generation == 2 and new.table.epoch == 2  # above the earlier one
    assert new.table.placement_map() == view.table.placement_map()  # type: ignore[union-attr]
    assert "ew-1" not in new.table.expert_workers and all(ews for ews in new.table.replicas.values())
    assert {"aw-0", "aw-1", "ew-1"} <= new.fenced
    assert new.add(_reg(Role.EXPERT, "ew-1", view, 1)) is None  # a dead one that comes back is fenced
    assert new.add(_reg(Role.ATTENTION)).id == "aw-2"  # type: ignore[union-attr]  # new ids above every old one
    # A fresh EW fills the vacant slot with exactly its experts, and the next epoch has it.
    spare = new.add(_reg(Role.EXPERT))
    assert spare is not None and spare.id == "ew-3"
    assignment = new.maybe_place()
    assert list(assignment) == ["ew-3"] and sorted(assignment["ew-3"]) == sorted(old.slot_units("ew-1"))
    assert spare.life.replaces == "ew-1"
    assert new.mark_ready("ew-3") and new.table.epoch == 3 and "ew-3" in new.table.expert_workers


def test_a_replacement_that_was_loading_fills_its_slot(hf_models: dict[str, Path]) -> None:
    old, _ = _running(hf_models["mixtral"])
    old.mark_dead("ew-2")
    spare = old.add(_reg(Role.EXPERT))
    assert spare is not None and old.maybe_place() == {spare.id: old.slot_units("ew-2")}
    view = old.view()  # the orchestrator dies while the replacement loads
    new = _cluster(hf_models["mixtral"], 2)
    for w in old.workers.values():
        if w.state is not WorkerState.DEAD:
            new.add(_reg(w.role, w.id, view, 1, slot=w.slot, experts=[list(u) for u in w.experts],
                         ready=w.id != spare.id))
    assert new.rebuild(view) == []  # nothing to replace: the replacement is on its way
    assert new.filling == {"ew-2": spare.id}
    assert new.mark_ready(spare.id) and spare.id in new.table.expert_workers  # type: ignore[union-attr]


def test_a_worker_whose_link_dropped_stays_in_the_view_until_declared_dead(hf_models: dict[str, Path]) -> None:
    c, _ = _running(hf_models["mixtral"])
    assert c.unreachable("ew-0")
    view = c.view()
    assert next(w for w in view.workers if w.id == "ew-0").serving
    c.publish()
    assert "ew-0" in c.table.expert_workers  # type: ignore[union-attr]  # peers keep using it
    rec = c.add(_reg(Role.EXPERT, "ew-0", view, 1, slot="ew-0", ready=True))
    assert rec is not None and rec.state is WorkerState.ALIVE
