"""An expert worker dies (SIGINT) mid-decode: AWs replay its in-flight calls on the shadows, the
orchestrator publishes the next epoch, and every stream finishes token-identical to the run
without the failure."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

from tests.conftest import running_fabric
from tests.helpers import get_json, iter_stream


def test_expert_worker_death_loses_nothing(hf_models: dict[str, Path], tmp_path: Path) -> None:
    prompts = [[3 + i, 40 + i, 7, 99 - i] for i in range(8)]
    body = {"max_tokens": 120, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    with running_fabric(hf_models["mixtral"], tmp_path, aws=2, ews=3) as fabric:
        base = f"http://127.0.0.1:{fabric.port}/v1/completions"
        cluster_url = f"http://127.0.0.1:{fabric.orchestrator_port}/cluster"

        received = [0]

        def run_all(on_first_token: threading.Event | None = None) -> list[list[int]]:
            out: list[list[int]] = [[] for _ in prompts]

            def one(i: int) -> None:
                for ev in iter_stream(base, {**body, "prompt": prompts[i]}):
                    out[i].extend(ev["choices"][0]["token_ids"])
                    received[0] += 1
                    assert "error" not in ev
                    if on_first_token is not None:
                        on_first_token.set()

            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            return_when_done = [t.join(120) for t in threads]
            assert len(return_when_done) == len(prompts)
            return out

        reference = run_all()
        assert all(len(r) == 120 for r in reference)
        before = get_json(cluster_url)
        assert before["epoch"] == 1
        victim = next(p for name, p in fabric.procs if name == "expert-worker-1")
        received[0] = 0
        started = threading.Event()
        result: list[list[list[int]]] = []
        runner = threading.Thread(target=lambda: result.append(run_all(started)))
        runner.start()
        assert started.wait(60)
        time.sleep(0.1)  # inside the decode phase of the 120-token streams
        victim.send_signal(signal.SIGINT)
        at_kill = received[0]
        runner.join(180)
        assert at_kill < len(prompts) * 120, "the streams ended before the kill"
        assert result and result[0] == reference  # nothing lost, nothing repeated, same tokens
        victim.wait(10)
        after = get_json(cluster_url)
        dead = [w for w in after["workers"] if w["pid"] == victim.pid]
        assert dead[0]["state"] == "dead" and after["epoch"] == 2
        assert all(dead[0]["id"] not in ews and ews for _, _, ews in after["routing"]["replicas"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # AW stats reach the orchestrator once a second
            stats = [w["stats"] for w in get_json(cluster_url)["workers"] if w["role"] == "attention"]
            if sum(s.get("replays", 0) for s in stats) >= 1:
                break
            time.sleep(0.2)
        assert sum(s.get("replays", 0) for s in stats) >= 1  # in-flight calls were replayed
        health = get_json(f"http://127.0.0.1:{fabric.port}/health")
        assert health["status"] == "ok"  # every expert still has a live copy
