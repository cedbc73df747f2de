"""Runtime scaling under streaming load (orchestrator/scaling.py, `moe-fabric scale`): AWs and EWs
added and drained while streams run, every stream token-identical to the failure-free run, none
lost; the moved experts are the planner's minimum; drained workers are never replaced; and bad
requests are refused with a reason."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fabric.errors import FabricError
from launch.local import Fabric
from launch.scale import ScaleConfig, scale
from tests.conftest import running_fabric
from tests.load import run_streams, wait_gone


def scale_under_load(fabric: Fabric, reference: list[list[int]], **counts: int) -> dict[str, Any]:
    """Scales while rounds of streams run (from before the request until after it returned);
    every round must equal the reference."""
    done = threading.Event()
    rounds: list[list[list[int]]] = []
    started = threading.Event()

    def load() -> None:
        while True:
            last = done.is_set()  # (one more round once the operation returned)
            rounds.append(run_streams(fabric, decoding=started))
            if last:
                return

    t = threading.Thread(target=load)
    t.start()
    assert started.wait(60)
    try:
        result = scale(ScaleConfig(orchestrator=f"127.0.0.1:{fabric.orchestrator_port}",
                                   cluster_secret_file=fabric.supervisor.secret_file, **counts))
    finally:
        done.set()
        t.join(300)
    assert len(rounds) >= 2 and all(r == reference for r in rounds)
    return result


def test_scale_out_and_in_under_load(hf_models: dict[str, Path], tmp_path: Path) -> None:
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=2) as fabric:
        reference = run_streams(fabric)
        before = fabric.cluster()
        out = scale_under_load(fabric, reference, attention_workers=3, expert_workers=3)
        cluster = fabric.cluster()
        alive = Counter(w["role"] for w in cluster["workers"] if w["state"] == "alive")
        assert alive["attention"] == 3 and alive["expert"] == 3
        new_ew = out["experts"]["joined"][0]
        assert cluster["redundancy"]["copies_min"] == 2 and cluster["redundancy"]["slots_vacant"] == 0
        # The planner's minimum (hand-checked in test_placement): the new EW takes its share of the
        # copies (2 copies of each unit over 3 EWs) and nothing else moves.
        units = len(before["routing"]["replicas"])
        holds = sum(new_ew in ews for _, _, ews in cluster["routing"]["replicas"])
        assert holds in ((2 * units) // 3, (2 * units + 2) // 3)
        assert out["experts"]["units_moved"] == holds and out["experts"]["moved_bytes"] > 0
        assert any(ews[0] == new_ew for _, _, ews in cluster["routing"]["replicas"])  # it serves as a primary
        assert cluster["routing"]["epoch"] > before["routing"]["epoch"]

        back = scale_under_load(fabric, reference, attention_workers=2, expert_workers=2)
        cluster = fabric.cluster()
        alive = Counter(w["role"] for w in cluster["workers"] if w["state"] == "alive")
        assert alive["attention"] == 2 and alive["expert"] == 2
        # The survivors still hold what they shed to the drained EW: taking it back moves nothing.
        assert back["experts"]["moved_bytes"] == 0
        drained = back["experts"]["drained"] + back["attention"]["drained"]
        assert len(drained) == 2 and all(
            w["state"] == "dead" for w in cluster["workers"] if w["id"] in drained)
        assert all(not set(drained) & set(ews) for _, _, ews in cluster["routing"]["replicas"])
        assert cluster["redundancy"]["copies_min"] == 2
        assert cluster["replacements_started"] == 0  # a drained worker is not replaced
        assert run_streams(fabric) == reference

        # Refused with a reason: nothing to do is fine, nonsense is not.
        with pytest.raises(FabricError, match="400"):
            _post(fabric, {"expert_workers": 0})
        with pytest.raises(FabricError, match="400"):
            _post(fabric, {"experts": 3})
        assert scale(ScaleConfig(orchestrator=f"127.0.0.1:{fabric.orchestrator_port}",
                                 cluster_secret_file=fabric.supervisor.secret_file, expert_workers=2)
                     )["experts"]["moved_bytes"] == 0
        with pytest.raises(urllib.error.HTTPError) as err:  # without the cluster secret
            urllib.request.urlopen(urllib.request.Request(
                f"http://127.0.0.1:{fabric.orchestrator_port}/cluster/scale", data=b'{"expert_workers": 3}',
                method="POST"), timeout=10)
        assert err.value.code == 401
        pids = {w["pid"] for w in cluster["workers"]} | {p.pid for _, p in fabric.procs}
    for p in pids:
        wait_gone(p, 15)


def _post(fabric: Fabric, body: dict[str, Any]) -> None:
    req = fabric.supervisor.admin_request("/cluster/scale", "POST")
    req.data = json.dumps(body).encode()
    try:
        urllib.request.urlopen(req, timeout=30).close()
    except urllib.error.HTTPError as exc:
        raise FabricError(f"{exc.code}") from None
