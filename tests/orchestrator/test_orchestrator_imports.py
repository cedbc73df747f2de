"""The orchestrator is restarted on the critical path of its own death: what it imports is its
restart time. torch alone takes seconds to import (10 s on a loaded 2-core host), so neither the
orchestrator nor what `moe-fabric orchestrator` loads on the way may import it. Nor may a gateway,
restarted on the critical path of its own death too (its clients reconnect to it), unless a request
asks for a grammar (xgrammar imports torch, in a thread, on first use). Nor may `serve`'s supervisor:
a fabric's processes start only after it has (its fork server imports torch once, for all of them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# (fabric.transport.tcp: what each of them loads once it makes its first connection)
@pytest.mark.parametrize("module", ["orchestrator.main", "gateway.main", "launch.supervisor", "fabric.transport.tcp"])
def test_the_orchestrator_the_gateway_and_the_supervisor_import_no_torch(module: str) -> None:
    code = f"import sys, launch.cli, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
