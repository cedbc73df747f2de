from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launch.config import ServeConfig
from launch.local import Fabric
from tests.helpers import free_port, write_hf_model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    models = {arch: write_hf_model(root / arch, arch) for arch in ("mixtral", "qwen3_moe")}
    # A qwen3_moe whose middle layer is a dense MLP (mlp_only_layers).
    models["qwen3_moe_dense"] = write_hf_model(root / "qwen3_moe_dense", "qwen3_moe", mlp_only_layers=[1])
    return models


@contextlib.contextmanager
def running_fabric(model: Path, tmp: Path, transport: str = "tcp", aws: int = 2, ews: int = 3,
                   extra: dict[str, list[str]] | None = None, env: dict[str, dict[str, str]] | None = None,
                   **overrides: Any) -> Iterator[Fabric]:
    """Starts a real multi-process fabric on loopback; always stops every process it started
    (replacements included: the supervisor starts them too)."""
    cfg = ServeConfig(model=str(model), attention_workers=aws, expert_workers=ews, transport=transport,
                      port=free_port(), ready_timeout=180, **overrides)
    logs = tmp / "logs"
    logs.mkdir(exist_ok=True)
    fabric = Fabric(cfg, extra_args=extra, log_dir=str(logs), extra_env=env)
    try:
        fabric.start()
        fabric.wait_ready(cfg.ready_timeout)
        yield fabric
    except BaseException:
        for f in sorted(logs.glob("*.log")):
            print(f"==== {f.name}\n" + f.read_text(errors="replace")[-3000:])
        raise
    finally:
        fabric.stop()
