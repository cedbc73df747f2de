"""When the fabric noticed a failure experiment's victim.

It reads the orchestrator's authoritative view (`GET /cluster`) for the first peer's suspicion, the
death's declaration, and the replacement's readiness."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launch.experiments.failover import Injection


def detection(inj: Injection, cluster: dict[str, Any] | None) -> dict[str, float | None]:
    """When the victim was declared dead and when its replacement was ready, from the orchestrator's view.

    For the orchestrator or a gateway, the replacement is its restarted self. Times are in seconds
    after the kill, on the wall clocks of one host."""
    out: dict[str, float | None] = {"suspected_s": None, "detected_s": None, "replacement_ready_s": None}
    if cluster is None or inj.kill_wall is None:
        return out
    workers = cluster["workers"]
    victim = next((w for w in workers if w["pid"] == inj.victim_pid), None)
    if victim is not None and victim["state"] == "dead":
        out["detected_s"] = victim["state_since"] - inj.kill_wall
        # An AW's stats, for an EW victim.
        found = [w["stats"].get("suspected_at", {}).get(victim["id"]) for w in workers]
        found = [t for t in found if t is not None]
        out["suspected_s"] = min(found) - inj.kill_wall if found else None
    role = inj.exp.args.role
    new = None
    # Every replacement of what the node hosted; the last one ready counts.
    if role == "node":
        fresh = [w for w in workers if w["role"] in ("attention", "expert", "checkpoint_store")
                 and w["state"] == "alive" and w["registered_at"] > inj.kill_wall]
        if fresh:
            out["replacement_ready_s"] = max(max(w["state_since"], w["registered_at"]) for w in fresh) - inj.kill_wall
        return out
    if victim is not None:
        new = next((w for w in workers if w["info"].get("replaces") == victim["id"] and w["state"] == "alive"), None)
    # AWs, stores and gateways take no slot, and the orchestrator is new. So take whoever came after the kill.
    if new is None:
        want = {"expert": "expert", "attention": "attention", "store": "checkpoint_store", "gateway": "gateway",
                "orchestrator": "orchestrator"}[role]
        new = next((w for w in workers if w["role"] == want and w["state"] == "alive"
                    and w["registered_at"] > inj.kill_wall), None)
    if new is not None:
        out["replacement_ready_s"] = max(new["state_since"], new["registered_at"]) - inj.kill_wall
    return out
