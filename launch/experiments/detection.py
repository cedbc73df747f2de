"""When the fabric noticed a failure experiment's victim, from the orchestrator's authoritative view
(`GET /cluster`): the first peer's suspicion, the death's declaration, the replacement's readiness."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launch.experiments.failover import Injection


def detection(inj: Injection, cluster: dict[str, Any] | None) -> dict[str, float | None]:
    """From the orchestrator's authoritative view: when the victim was declared dead and when its
    replacement (or, for the orchestrator or a gateway, its restarted self) was ready, in seconds
    after the kill (wall clocks of one host)."""
    out: dict[str, float | None] = {"suspected_s": None, "detected_s": None, "replacement_ready_s": None}
    if cluster is None or inj.kill_wall is None:
        return out
    workers = cluster["workers"]
    victim = next((w for w in workers if w["pid"] == inj.victim_pid), None)
    if victim is not None and victim["state"] == "dead":
        out["detected_s"] = victim["state_since"] - inj.kill_wall
        found = [w["stats"].get("suspected_at", {}).get(victim["id"]) for w in workers]  # an AW, for an EW victim
        found = [t for t in found if t is not None]
        out["suspected_s"] = min(found) - inj.kill_wall if found else None
    role = inj.exp.args.role
    new = None
    if role == "node":  # every replacement of what the node hosted: the last one ready
        fresh = [w for w in workers if w["role"] in ("attention", "expert", "checkpoint_store")
                 and w["state"] == "alive" and w["registered_at"] > inj.kill_wall]
        if fresh:
            out["replacement_ready_s"] = max(max(w["state_since"], w["registered_at"]) for w in fresh) - inj.kill_wall
        return out
    if victim is not None:
        new = next((w for w in workers if w["info"].get("replaces") == victim["id"] and w["state"] == "alive"), None)
    if new is None:  # AWs, stores and gateways take no slot; the orchestrator is new: whoever came after the kill
        want = {"expert": "expert", "attention": "attention", "store": "checkpoint_store", "gateway": "gateway",
                "orchestrator": "orchestrator"}[role]
        new = next((w for w in workers if w["role"] == want and w["state"] == "alive"
                    and w["registered_at"] > inj.kill_wall), None)
    if new is not None:
        out["replacement_ready_s"] = max(new["state_since"], new["registered_at"]) - inj.kill_wall
    return out
