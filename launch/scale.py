"""`moe-fabric scale`: has a running fabric add or drain workers while it serves.

It asks the orchestrator (`POST /cluster/scale`, with the cluster secret) and prints what moved."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from fabric.auth import load_secret
from fabric.config_fields import SECRET_HELP, TLS_CERT_HELP, TLS_KEY_HELP, opt, parse_hostport, req
from fabric.errors import ConfigError, FabricError
from fabric.tls import Tls


@dataclass(frozen=True)
class ScaleConfig:
    orchestrator: str = req("the orchestrator's address (`serve` prints it when ready)", metavar="HOST:PORT")
    attention_workers: int | None = opt(None, "attention workers to have (drained ones leave; their requests "
                                              "resume on the others from their KV checkpoints)")
    expert_workers: int | None = opt(None, "expert workers to have (the placement moves the fewest experts)")
    cluster_secret_file: str | None = opt(None, SECRET_HELP, metavar="PATH")
    tls_cert: str | None = opt(None, TLS_CERT_HELP, metavar="PATH")
    tls_key: str | None = opt(None, TLS_KEY_HELP, metavar="PATH")
    timeout: float = opt(600.0, "seconds to wait for the operation")

    def __post_init__(self) -> None:
        parse_hostport(self.orchestrator)
        if self.attention_workers is None and self.expert_workers is None:
            raise ConfigError("say how many workers to have: --attention-workers N and/or --expert-workers M")
        for n in (self.attention_workers, self.expert_workers):
            if n is not None and not 1 <= n <= 4096:
                raise ConfigError("worker counts must be in 1..4096")


def scale(cfg: ScaleConfig) -> dict[str, Any]:
    host, port = parse_hostport(cfg.orchestrator)
    tls = Tls.of(cfg.tls_cert, cfg.tls_key)
    secret = load_secret(cfg.cluster_secret_file)
    body = {k: v for k, v in (("attention_workers", cfg.attention_workers), ("expert_workers", cfg.expert_workers))
            if v is not None}
    req_ = urllib.request.Request(f"{'https' if tls else 'http'}://{host}:{port}/cluster/scale", method="POST",
                                  data=json.dumps(body).encode(), headers={"Content-Type": "application/json",
                                  **({"Authorization": f"Bearer {secret.decode()}"} if secret else {})})
    try:
        with urllib.request.urlopen(req_, timeout=cfg.timeout, context=tls.client if tls else None) as r:
            return dict(json.loads(r.read()))
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace").strip()
        try:
            text = json.loads(text).get("error", text)
        except ValueError:
            pass
        raise FabricError(f"the orchestrator refused: {exc.code} {text}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise FabricError(f"cannot reach the orchestrator at {host}:{port}: {exc}") from None


def run(cfg: ScaleConfig) -> int:
    print(json.dumps(scale(cfg), indent=1))
    sys.stdout.flush()
    return 0
