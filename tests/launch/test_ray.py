"""`serve --cluster ray` on a real Ray cluster: three nodes (raylets) on loopback and a head that
takes no fabric process. The fabric comes up placed by failure domain, serves the same greedy
tokens as transformers, survives a whole node's death (an AW, an EW and a gateway at once) with
every stream token-identical and replacements on the surviving nodes, and survives the death of
the orchestrator's node, the orchestrator coming back on another node."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launch.loopback_ray import LoopbackRay  # (first: Ray's loopback switch before Ray is imported)
from launch.ray_host import node_label
from tests.conftest import running_fabric
from tests.helpers import post_json, resumable_stream, wait_for
from tests.load import BODY, PROMPTS, TOKENS
from tests.system.test_parity import assert_matches, reference

ROLE_RESOURCES = {f"{r}_resources": '{"fabric": 1}' for r in ("orchestrator", "gateway", "aw", "ew", "store")}


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LoopbackRay]:
    cluster = LoopbackRay(nodes=3, resources={"fabric": 16})
    try:
        yield cluster
    finally:
        cluster.shutdown()


def streams(port: int, decoding: threading.Event | None = None) -> list[list[int]]:
    """8 concurrent seeded streams, each resumed with Last-Event-ID when its gateway dies;
    `decoding` is set once they are, on average, a few tokens into their decode."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    out: list[list[int]] = [[] for _ in PROMPTS]
    count = [0]

    def seen(ev: dict[str, Any]) -> None:
        count[0] += 1
        if decoding is not None and count[0] >= 4 * len(PROMPTS):
            decoding.set()

    def one(i: int) -> None:
        events, _ = resumable_stream(url, {**BODY, "prompt": PROMPTS[i]}, deadline=150, on_event=seen)
        for ev in events:
            assert "error" not in ev, ev
            out[i].extend(ev["choices"][0]["token_ids"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


def on_other_nodes(fabric: Any, node_id: str) -> dict[str, int]:
    """Every worker and gateway alive on a node other than `node_id`: id -> pid."""
    return {w["id"]: w["pid"] for w in fabric.cluster()["workers"] if w["state"] == "alive"
            and w["role"] != "orchestrator" and w["info"].get("node") != node_label(node_id)}


def under_node_death(fabric: Any, ray_cluster: LoopbackRay, node_id: str) -> list[list[int]]:
    """The streams, with `node_id` removed (SIGKILL of its raylet and every process of it) once
    every stream is a few tokens into its decode. No process of another node is restarted (a Ray
    error about a survivor's actor is not its death)."""
    survivors = on_other_nodes(fabric, node_id)
    result: list[list[list[int]]] = []
    decoding = threading.Event()
    runner = threading.Thread(target=lambda: result.append(streams(fabric.port, decoding)))
    runner.start()
    assert decoding.wait(60)
    ray_cluster.remove_node(node_id)
    runner.join(200)
    assert result
    after = wait_for(fabric, "the orchestrator serving", lambda c: not c.get("recovering"), 120)
    alive = {w["id"]: w["pid"] for w in after["workers"] if w["state"] == "alive"}
    assert {i: alive.get(i) for i in survivors} == survivors, "a process of a surviving node was restarted"
    return result[0]


def assert_greedy_parity(port: int, model: Path, prompts: list[list[int]], n: int) -> None:
    for prompt, (tokens, logits) in zip(prompts, reference(model, prompts, [n] * len(prompts))):
        status, body = post_json(f"http://127.0.0.1:{port}/v1/completions",
                                 {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                                  "return_token_ids": True})
        assert status == 200, body
        assert_matches(body["choices"][0]["token_ids"], tokens, logits, f"ray {model.name}")


def nodes_of_experts(cluster: dict[str, Any]) -> dict[tuple[int, int], set[str]]:
    node = {w["id"]: w["info"].get("node") for w in cluster["workers"]}
    return {(layer, e): {node[w] for w in ews} for layer, e, ews in cluster["routing"]["replicas"]}


def test_serve_on_ray_survives_node_deaths(hf_models: dict[str, Path], tmp_path: Path,
                                           ray_cluster: LoopbackRay) -> None:
    model = hf_models["mixtral"]
    with running_fabric(model, tmp_path, aws=2, ews=3, cluster="ray", ray_address=ray_cluster.address,
                        **ROLE_RESOURCES) as fabric:
        sup = fabric.supervisor
        fabric_nodes = {node_label(n) for n in ray_cluster.nodes}
        first = fabric.cluster()
        workers = [w for w in first["workers"] if w["role"] != "orchestrator"]
        assert {w["info"]["node"] for w in workers} <= fabric_nodes  # on the three nodes, none on the head
        aw_nodes = {w["info"]["node"] for w in workers if w["role"] == "attention"}
        store_nodes = {w["info"]["node"] for w in workers if w["role"] == "checkpoint_store"}
        assert len(aw_nodes) == 2 and not aw_nodes & store_nodes  # AWs apart, the store away from them
        spread = nodes_of_experts(first)
        assert spread and all(len(nodes) == 2 for nodes in spread.values()), spread  # primary, shadow: 2 nodes

        assert_greedy_parity(fabric.port, model, [[5, 17, 33, 2, 81], [9, 9, 40, 120, 7, 64, 3]], 12)

        # A node with an AW, an EW and a gateway dies under 8 streams.
        ref = streams(fabric.port)
        assert all(len(r) == TOKENS for r in ref)
        victim = sup.node_of("attention-worker-0")
        on_victim = {w["id"] for w in workers if w["info"]["node"] == node_label(victim)}
        assert any(w.startswith("ew-") for w in on_victim) and any(w.startswith("aw-") for w in on_victim)
        assert under_node_death(fabric, ray_cluster, victim) == ref
        survivors = fabric_nodes - {node_label(victim)}

        def healed(c: dict[str, Any]) -> bool:
            alive = [w for w in c["workers"] if w["state"] == "alive"]
            return (sum(w["role"] == "attention" for w in alive) == 2 and sum(w["role"] == "expert" for w in alive) == 3
                    and sum(w["role"] == "gateway" for w in alive) == 2 and c["redundancy"]["copies_min"] == 2
                    and c["redundancy"]["slots_vacant"] == 0)

        cluster = wait_for(fabric, "replacements on the surviving nodes", healed, timeout=120)
        new = [w for w in cluster["workers"] if w["state"] == "alive" and w["id"] not in {x["id"] for x in workers}]
        assert {w["role"] for w in new} >= {"attention", "expert"}
        assert all(w["info"]["node"] in survivors for w in new)  # never on the dead node
        assert all(w["info"]["node"] in survivors for w in cluster["workers"] if w["state"] == "alive"
                   and w["role"] != "orchestrator")
        assert streams(fabric.port) == ref  # the replacements serve

        # The orchestrator's node dies: serving goes on, the orchestrator comes back elsewhere.
        orch_node = sup.node_of("orchestrator")
        generation = cluster["generation"]
        assert under_node_death(fabric, ray_cluster, orch_node) == ref
        back = wait_for(fabric, "the orchestrator on another node", lambda c: c["generation"] > generation
                        and not c.get("recovering"), timeout=120)
        assert sup.node_of("orchestrator") not in (orch_node, victim)
        assert sum(w["role"] == "attention" and w["state"] == "alive" for w in back["workers"]) >= 1
        assert streams(fabric.port) == ref


def test_serve_on_ray_qwen3_greedy_parity(hf_models: dict[str, Path], tmp_path: Path,
                                          ray_cluster: LoopbackRay) -> None:
    """The other test checkpoint, on the nodes left by the test above (or all three), small."""
    model = hf_models["qwen3_moe"]
    with running_fabric(model, tmp_path, aws=1, ews=2, gateways=1, checkpoint_stores=0, checkpoint="off",
                        cluster="ray", ray_address=ray_cluster.address, **ROLE_RESOURCES) as fabric:
        assert_greedy_parity(fabric.port, model, [[11, 4, 250, 31], [7, 7, 7, 100, 3, 42]], 10)
