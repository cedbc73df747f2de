"""The gateway's per-token metrics, counted as plain numbers (`StreamedTokens`), read at a scrape as prometheus' own
Histogram and Counter would have them: the same samples, bucket for bucket, at every bound and between them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from gateway.metrics import LATENCY_BUCKETS, Metrics


def _samples(text: bytes, names: tuple[str, ...]) -> list[str]:
    return [line for line in text.decode().splitlines()
            if line.startswith(names) and "_created" not in line and not line.startswith("#")]


def test_streamed_tokens_read_as_prometheus_would_count_them() -> None:
    gaps: list[float | None] = [None, *LATENCY_BUCKETS, *(b * 1.0001 for b in LATENCY_BUCKETS), 0.0, 1e-9, 500.0, None,
                                0.003, 0.07, 0.07]
    metrics = Metrics()
    registry = CollectorRegistry()
    tbt = Histogram("moe_fabric_time_between_tokens_seconds", "Time between tokens of a stream",
                    buckets=LATENCY_BUCKETS, registry=registry)
    generated = Counter("moe_fabric_generated_tokens", "Generated tokens", registry=registry)
    names = ("moe_fabric_time_between_tokens_seconds", "moe_fabric_generated_tokens")
    for gap in gaps:
        metrics.streamed.add(gap)
        generated.inc()
        if gap is not None:
            tbt.observe(gap)
    ours, theirs = _samples(metrics.render(), names), _samples(generate_latest(registry), names)
    assert ours == theirs
    assert f"moe_fabric_generated_tokens_total {float(len(gaps))}" in ours
    assert 'moe_fabric_time_between_tokens_seconds_bucket{le="+Inf"} ' + f"{float(len(gaps) - 2)}" in ours
