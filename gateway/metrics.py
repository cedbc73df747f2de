"""Prometheus metrics of the gateway.

Names are prefixed `moe_fabric_`. The per-worker gauges are refreshed from the orchestrator's
cluster view at each scrape.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from itertools import accumulate
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.n_waiting = 0  # mirrors the waiting gauge, for the gateway's queue limit
        self.waiting_by_origin: dict[str, int] = {}  # share of the queue per client address
        self.running = Gauge("moe_fabric_requests_running", "Requests producing tokens", registry=r)
        self.waiting = Gauge("moe_fabric_requests_waiting", "Requests admitted but without a first token yet", registry=r)
        self.finished = Counter("moe_fabric_requests_finished", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("moe_fabric_request_errors", "Failed requests by HTTP status", ["status"], registry=r)
        self.ttft = Histogram("moe_fabric_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("moe_fabric_e2e_latency_seconds", "Request latency, arrival to last token", buckets=LATENCY_BUCKETS, registry=r)
        self.streamed = StreamedTokens()  # moe_fabric_generated_tokens, moe_fabric_time_between_tokens_seconds
        r.register(self.streamed)
        self.prompt = Counter("moe_fabric_prompt_tokens", "Prompt tokens", registry=r)
        self.kv_used = Gauge("moe_fabric_kv_blocks_used", "KV cache blocks in use per attention worker", ["worker"], registry=r)
        self.kv_free = Gauge("moe_fabric_kv_blocks_free", "Free KV cache blocks per attention worker", ["worker"], registry=r)
        self.stores = Gauge("moe_fabric_checkpoint_stores_alive", "Live KV checkpoint stores (0: AW failures replay)", registry=r)
        self.expert_tokens = Gauge("moe_fabric_expert_tokens_processed", "Tokens processed per expert worker and expert", ["worker", "layer", "expert"], registry=r)

    def enter_waiting(self, origin: str) -> None:
        self.n_waiting += 1
        self.waiting_by_origin[origin] = self.waiting_by_origin.get(origin, 0) + 1
        self.waiting.inc()

    def leave_waiting(self, origin: str, running: bool) -> None:
        self.n_waiting -= 1
        left = self.waiting_by_origin[origin] - 1
        if left:
            self.waiting_by_origin[origin] = left
        else:
            del self.waiting_by_origin[origin]
        self.waiting.dec()
        if running:
            self.running.inc()

    def update_cluster(self, cluster: dict[str, Any]) -> None:
        for w in cluster.get("workers", []):
            stats = w.get("stats") or {}
            if w.get("role") == "attention" and "kv_blocks_used" in stats:
                self.kv_used.labels(w["id"]).set(stats["kv_blocks_used"])
                self.kv_free.labels(w["id"]).set(stats["kv_blocks_free"])
            elif w.get("role") == "expert":
                for unit, n in (stats.get("tokens_by_expert") or {}).items():
                    layer, _, expert = str(unit).partition(":")
                    self.expert_tokens.labels(w["id"], layer, expert).set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StreamedTokens:
    """The tokens streamed, and the times between a stream's tokens, counted a token at a time as plain numbers on the
    gateway's loop and exported at each scrape (`collect`). A prometheus Histogram's observe and a Counter's inc take
    a lock each and walk the buckets in Python: 6 % of a gateway's Python time at 64 streams (cProfile)."""

    def __init__(self) -> None:
        self.count = 0
        self.gaps = [0] * (len(LATENCY_BUCKETS) + 1)  # by bucket: at most each bound, then over them all (+Inf)
        self.gap_sum = 0.0

    def add(self, gap: float | None) -> None:
        """One token streamed, `gap` seconds after its stream's last (None for a stream's first)."""
        self.count += 1
        if gap is not None:
            self.gaps[bisect_left(LATENCY_BUCKETS, gap)] += 1  # (the first bound >= gap: a histogram's `le`)
            self.gap_sum += gap

    def collect(self) -> Iterator[Metric]:
        bounds = [*map(floatToGoString, LATENCY_BUCKETS), "+Inf"]
        yield HistogramMetricFamily("moe_fabric_time_between_tokens_seconds", "Time between tokens of a stream",
                                    buckets=list(zip(bounds, accumulate(self.gaps))), sum_value=self.gap_sum)
        yield CounterMetricFamily("moe_fabric_generated_tokens", "Generated tokens", value=self.count)
