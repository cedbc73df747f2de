"""Expert load balancing: the balancer's verdicts on hand-made counts, and a fabric under a skewed
workload (every stream the same prompt) that ends with an overloaded EW's hot expert copied onto
spare capacity and served by all its replicas at once, each taking part of its rows, and every
stream token-identical throughout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from orchestrator.balancer import ExpertBalancer
from tests.conftest import running_fabric
from tests.helpers import iter_stream, wait_for


def test_balancer_evens_the_ews_load_and_cools_down() -> None:
    b = ExpertBalancer(hot_factor=1.5, min_rows=10)
    replicas = {(0, 0): ["A", "B"], (0, 1): ["B", "A"], (0, 2): ["A", "B"], (0, 3): ["B", "A"], (0, 4): ["A"]}
    # Hand-checked: A serves 70 + 10 = 80 rows, B 20; mean 50, A over 1.5x. A's hottest unit with a
    # copy that does not serve yet is (0, 0): spread over A and B, A has 45 and B 55: balanced.
    # An EW's counts when first seen are no round (a restarted orchestrator sees all-time counts).
    assert b.rows_since_last({"ew-a": {(0, 0): 900}, "ew-b": {}}) == {}
    ew_a = {(0, 0): 940, (0, 2): 10}
    ew_b = {(0, 0): 30, (0, 1): 10, (0, 3): 10}
    rows = b.rows_since_last({"ew-a": ew_a, "ew-b": ew_b})
    assert rows == {(0, 0): 70, (0, 1): 10, (0, 2): 10, (0, 3): 10}
    active = b.decide(rows, replicas, {})
    assert active == {(0, 0): 2}
    # Counts are cumulative: only the rows since the last round count. Now (0, 0) has 30 rows:
    # without its second replica A would serve 55 and B 45, under the midpoint (1.25x): it cools.
    ew_a = {(0, 0): 955, (0, 2): 35}
    ew_b = {(0, 0): 45, (0, 1): 35, (0, 3): 30}
    rows = b.rows_since_last({"ew-a": ew_a, "ew-b": ew_b})
    assert rows == {(0, 0): 30, (0, 1): 25, (0, 2): 25, (0, 3): 20}
    assert b.decide(rows, replicas, active) == {}
    # A hot unit with no other copy cannot be spread; a round with too few rows keeps its state.
    assert b.decide({(0, 4): 100, (0, 1): 10}, replicas, {}) == {}
    assert b.decide({(0, 0): 5}, replicas, {(0, 2): 2}) == {(0, 2): 2}
    # Balanced load: nothing is spread (spreading costs a second read of the expert's weights).
    assert b.decide({(0, 0): 20, (0, 1): 20, (0, 2): 20, (0, 3): 20}, replicas, {}) == {}
    # Per layer (a layer's step waits for its busiest EW): a skewed layer is evened even where the
    # EWs' totals over all layers would look balanced.
    both = replicas | {(1, e): list(reversed(rs)) for (_, e), rs in replicas.items() if len(rs) == 2}
    skewed = {(0, 0): 20, (0, 1): 20, (0, 2): 20, (0, 3): 20, (1, 0): 70, (1, 1): 10, (1, 2): 10, (1, 3): 10}
    assert b.decide(skewed, both, {}) == {(1, 0): 2}
    # Every copy of the hot unit serves and an EW is still overloaded: a new copy on spare capacity.
    # Hand-checked (1.2x): A 100, B 10, C 10 -> (0, 0) on A and B: 50, 60, 10 -> (0, 2) on B and C:
    # 50, 55, 15, B still over 48 and all its units' copies serve: one more copy of (0, 0), on C.
    b3 = ExpertBalancer(hot_factor=1.2, min_rows=10)
    three = {(0, 0): ["A", "B"], (0, 1): ["C", "A"], (0, 2): ["B", "C"]}
    assert b3.decide({(0, 0): 100, (0, 1): 10, (0, 2): 10}, three, {}) == {(0, 0): 2, (0, 2): 2}
    assert b3.grow == [((0, 0), "C")]
    # An EW that restarted (its counts went down) counts from zero again.
    rows = b.rows_since_last({"ew-a": {(0, 0): 5}, "ew-b": ew_b})
    assert rows == {(0, 0): 5}


SAME_PROMPT = [5, 17, 33, 2]
BODY = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


def skewed_round(port: int, n: int = 6) -> list[list[int]]:
    """n concurrent greedy streams of one prompt: every row of a step goes to the same experts."""
    import threading

    out: list[list[int]] = [[] for _ in range(n)]

    def one(i: int) -> None:
        for ev in iter_stream(f"http://127.0.0.1:{port}/v1/completions", {**BODY, "prompt": SAME_PROMPT}):
            assert "error" not in ev, ev
            out[i].extend(ev["choices"][0]["token_ids"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def counts(cluster: dict[str, Any], unit: tuple[int, int]) -> dict[str, int]:
    key = f"{unit[0]}:{unit[1]}"
    return {w["id"]: w["stats"].get("tokens_by_expert", {}).get(key, 0)
            for w in cluster["workers"] if w["role"] == "expert" and w["state"] == "alive"}


def test_a_skewed_load_ends_with_hot_experts_spread(hf_models: dict[str, Path], tmp_path: Path) -> None:
    with running_fabric(hf_models["qwen3_moe"], tmp_path, aws=1, ews=3, balance_interval_s=0.3,
                         hot_expert_factor=1.0) as fabric:
        reference = skewed_round(fabric.port)
        assert all(r == reference[0] for r in reference)
        # Load goes on until the orchestrator has spread a hot expert over a third copy it made
        # (on spare capacity: every unit starts with two copies, on two of the three EWs).
        for _ in range(30):
            if any(len(ews) == 3 for _, _, ews in fabric.cluster()["routing"]["replicas"]):
                break
            assert skewed_round(fabric.port) == reference
        cluster = fabric.cluster()
        grown = [(lyr, e, ews) for lyr, e, ews in cluster["routing"]["replicas"] if len(ews) == 3]
        assert grown
        layer, expert, replicas = grown[0]
        active = {(lyr, e): n for lyr, e, n in cluster["routing"]["active"]}
        assert active.get((layer, expert)) == 3  # every copy of it serves
        before = counts(cluster, (layer, expert))
        assert skewed_round(fabric.port) == reference  # rows spread over three EWs: the same tokens
        after = wait_for(fabric, "the EWs' new counts", lambda c: all(
            counts(c, (layer, expert))[ew] > before[ew] for ew in replicas))
        assert all(counts(after, (layer, expert))[ew] > before[ew] for ew in replicas)  # each replica served it
