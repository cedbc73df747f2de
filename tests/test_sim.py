"""The simulated compute backend (`--compute sim`): a fabric on a checkpoint directory that holds
only a config.json runs everything but the tensor math; its outputs are deterministic, depend on
the experts that ran, and survive an EW's and an AW's death token for token."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import torch

from expert_worker.gather import PendingCall
from expert_worker.sim_executor import SimExecutor, sim_factor
from fabric.messages.expert import ExpertCall
from fabric.model.config import ModelConfig
from tests.conftest import running_fabric
from tests.helpers import wait_for
from tests.load import kill_mid_decode, run_streams


def config_only(src: Path, dst: Path, **over: object) -> Path:
    dst.mkdir(parents=True)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **over}))
    for f in src.iterdir():  # the tokenizer, if any; never the weights
        if f.name.startswith("tokenizer") or f.name == "generation_config.json":
            shutil.copy(f, dst / f.name)
    return dst


def test_a_sim_expert_worker_scales_each_row_by_its_experts_factor(hf_models: dict[str, Path]) -> None:
    cfg = ModelConfig.from_dir(hf_models["mixtral"])
    ex = SimExecutor(cfg, expert_ms=0.0, expert_row_us=0.0)
    ex.load("", [(1, 2), (1, 5)])
    x = torch.randn(5, cfg.hidden_size)
    call = ExpertCall(call_id=1, layer=1, epoch=1, experts=[2, 5], counts=[2, 3], x=x)
    (y,) = ex.run([PendingCall("aw-0", None, call)])  # type: ignore[arg-type]
    assert torch.equal(y[:2], x[:2] * sim_factor(1, 2)) and torch.equal(y[2:], x[2:] * sim_factor(1, 5))
    assert sim_factor(1, 2) != sim_factor(1, 5) and ex.tokens_by_expert == {(1, 2): 2, (1, 5): 3}
    assert ex.experts.keys() == {(1, 2), (1, 5)} and ex.bytes_read == ex.bytes_mapped == 0


def test_a_sim_fabric_survives_ew_and_aw_deaths_token_for_token(hf_models: dict[str, Path], tmp_path: Path) -> None:
    # Wider than the test checkpoint (so the wire carries more), and no weights at all.
    model = config_only(hf_models["mixtral"], tmp_path / "sim-model", hidden_size=512, num_hidden_layers=6)
    assert not list(model.glob("*.safetensors"))
    with running_fabric(model, tmp_path, aws=2, ews=3, compute="sim", sim_attention_ms=0.2,
                        sim_expert_ms=0.2) as fabric:
        reference = run_streams(fabric)
        cluster = wait_for(fabric, "the EWs' stats", lambda c: all(
            "kernel" in w["stats"] for w in c["workers"] if w["role"] == "expert"))
        ews = [w for w in cluster["workers"] if w["role"] == "expert"]
        assert all(w["stats"]["kernel"] == "sim" and w["stats"]["expert_mib_read"] == 0 for w in ews)
        assert sum(sum(w["stats"]["tokens_by_expert"].values()) for w in ews) > 0
        assert run_streams(fabric) == reference  # deterministic
        assert len({tuple(r) for r in reference}) > 1  # and not one stream for every prompt
        _, outputs, _ = kill_mid_decode(fabric, "expert-worker-1", signal.SIGINT, reference=reference)
        assert outputs == reference
        _, outputs, _ = kill_mid_decode(fabric, "attention-worker-0", signal.SIGINT, reference=reference)
        assert outputs == reference
