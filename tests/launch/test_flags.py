"""Config written once: every role's flags come from its config dataclass, a config goes to a child
as flags and comes back equal; sampling and stream positions at their limits."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any

import pytest
import torch

from attention_worker.sampler import GREEDY_BELOW, greedy, sample, token_logprobs
from fabric.config import AttentionWorkerConfig, ExpertWorkerConfig, GatewayConfig, OrchestratorConfig
from fabric.config_fields import parse_cpus
from fabric.errors import ConfigError
from gateway.protocol import ApiError
from gateway.streaming import Position
from launch.cli import build_parser
from launch.config import ServeConfig
from launch.flags import add_flags, from_args, to_argv


@pytest.mark.parametrize("cfg", [
    AttentionWorkerConfig(model="/m", orchestrator="h:1", probe_misses=5, checkpoint="off", dtype="bfloat16",
                          cpu_latency_us=20),
    ExpertWorkerConfig(model="/m", orchestrator="h:1", gather="threshold", max_wait_ms=3.5, watch_pid=7, cpus="0-1,3"),
    GatewayConfig(model="/m", orchestrator="h:1", reuse_port=True, stream_resume_grace_s=0.0, port=0,
                  cluster_secret_file="/s", public_metrics=True, tls_cert="/c", tls_key="/k"),
    OrchestratorConfig(model="/m", expert_workers=3, recovery_grace_s=0.5, generation=9, cluster_secret_file="/s"),
    ServeConfig(gateways=3, provisioner="none", api_key="k", auth=False, pin_workers=True, max_batch_tokens=128,
                cpu_latency_us=-1),
    ServeConfig(cluster_secret_file="/s", tls_cert="/c", tls_key="/k"),
], ids=["attention", "expert", "gateway", "orchestrator", "serve", "serve-secured"])
def test_a_config_survives_its_flags(cfg: object) -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser, type(cfg))
    assert from_args(type(cfg), parser.parse_args(to_argv(cfg))) == cfg


def test_serve_hands_the_step_budget_to_its_attention_workers() -> None:
    roles = ServeConfig(max_batch_tokens=128).role_configs("/m", "tcp", 1, 1, None)
    assert roles.attention.max_batch_tokens == 128
    with pytest.raises(ConfigError, match="max_batch_tokens"):
        ServeConfig(max_batch_tokens=0)


def test_serve_sends_collapsed_layers_onto_one_ew_where_its_workers_outnumber_the_cpus(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def onto(cpus: int, **kw: Any) -> str:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
        return ServeConfig(**kw).role_configs("/m", "tcp", 1, 1, None).attention.collapse_onto

    assert onto(2) == "one" and onto(3) == "one"  # 2 AW + 2 EW
    assert onto(4) == "turns" and onto(64) == "turns"  # a core each
    assert onto(4, expert_workers=3) == "one"
    assert onto(2, collapse_onto="turns") == "turns" and onto(64, collapse_onto="one") == "one"  # as asked
    assert onto(2, cluster="ray") == "turns"  # on Ray each node has its own cores
    with pytest.raises(ConfigError, match="collapse_onto"):
        AttentionWorkerConfig(model="m", orchestrator="h:1", collapse_onto="spread")
    with pytest.raises(ConfigError, match="collapse_onto"):
        ServeConfig(collapse_onto="spread")


def test_every_subcommand_parses_its_defaults() -> None:
    parser = build_parser()
    assert parser.parse_args(["attention-worker", "--model", "m", "--orchestrator", "h:1"]).kv_cache_mib == 256
    assert parser.parse_args(["serve"]).gateways == 2
    with pytest.raises(SystemExit):
        parser.parse_args(["expert-worker", "--model", "m", "--orchestrator", "h:1", "--gather", "fifo"])


def test_cpu_lists_parse_as_taskset_takes_them() -> None:
    assert parse_cpus("0") == {0} and parse_cpus("0-2,5") == {0, 1, 2, 5} and parse_cpus(" 3 , 1") == {1, 3}
    for bad in ("", "a", "2-1", "1-", "-1", "0,,1"):
        with pytest.raises(ConfigError, match="CPU list"):
            parse_cpus(bad)
    with pytest.raises(ConfigError, match="CPU list"):
        ExpertWorkerConfig(model="/m", orchestrator="h:1", cpus="x")


@pytest.mark.parametrize("temperature", [1e-300, 1e-38, 5e-324, GREEDY_BELOW / 2, math.nan])
def test_tiny_or_broken_temperatures_are_greedy(temperature: float) -> None:
    logits = torch.randn(50) * 10
    assert sample(logits, temperature, 1.0, -1, 3, 0) == int(logits.argmax())


def test_a_distribution_that_is_not_finite_does_not_reach_multinomial() -> None:
    logits = torch.tensor([1.0, math.nan, 3.0, math.inf])
    assert sample(logits, 1.0, 1.0, -1, 3, 0) == greedy(logits) == 3
    lp, top = token_logprobs(torch.tensor([0.0, -math.inf]), 1, 2)
    assert lp == -9999.0 and top is not None and all(math.isfinite(v) for _, v in top)


def test_stream_positions_roundtrip_and_refuse_strangers() -> None:
    pos = Position("chatcmpl-" + "a" * 32, 2**64 - 1, [3, 0], usage_sent=True)
    assert Position.parse(pos.event_id(), chat=True, n=2) == pos
    for raw in [pos.event_id(), "cmpl-" + "a" * 32 + ":1:3", "x:1:2", "chatcmpl-" + "a" * 32 + ":-1:2,2",
                "chatcmpl-" + "a" * 32 + ":1:2,2:z"]:
        with pytest.raises(ApiError):
            Position.parse(raw, chat=True, n=1)
