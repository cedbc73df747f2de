"""No query of death: no sampling parameter that validation lets through kills a process, and a
request that kills every AW it runs on (a test-only fault hook crashes any AW that serves it) fails
alone, with a clear error, after at most two deaths, while every other request completes
token-identical to the failure-free run."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from fabric.faults import CRASH_ENV
from fabric.messages.client import Submit
from gateway.aw_client import Pending
from gateway.generation import Choice, GenerationError, _resume, start_choice
from tests.conftest import running_fabric
from tests.helpers import iter_stream, post_json, wait_for
from tests.load import BODY, PROMPTS, run_streams

EXTREMES = [
    {"temperature": 1e-300}, {"temperature": 1e-38}, {"temperature": 5e-324}, {"temperature": 1e-6},
    {"temperature": 2.0, "top_p": 1e-9}, {"temperature": 2, "top_k": 1}, {"temperature": 1.5, "top_k": 256},
    {"temperature": 1e-300, "top_p": 1e-9, "top_k": 2, "logprobs": 20},
    {"temperature": 0.7, "seed": -(2**63)}, {"temperature": 0.7, "seed": 2**64 - 1, "n": 16},
    {"temperature": 2.0, "logprobs": 20, "max_tokens": 300}, {"temperature": 0, "stop": ["\x00" * 8] * 16},
]


def test_no_sampling_extreme_kills_a_process(hf_models: dict[str, Path], tmp_path: Path) -> None:
    with running_fabric(hf_models["mixtral"], tmp_path, aws=1, ews=1, gateways=1, checkpoint_stores=0) as fabric:
        url = f"http://127.0.0.1:{fabric.port}/v1/completions"
        pids = {n: p.pid for n, p in fabric.procs}
        for extreme in EXTREMES:
            body = {"prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True, **extreme}
            status, out = post_json(url, body)
            assert status == 200, (extreme, out)
            assert all(len(c["text"]) >= 0 and c["finish_reason"] == "length" for c in out["choices"]), extreme
            events = list(iter_stream(url, body))
            assert "error" not in events[-1] and events[-1]["choices"][0]["finish_reason"] == "length", extreme
        assert {n: p.pid for n, p in fabric.procs} == pids and all(p.poll() is None for _, p in fabric.procs)
        assert all(w["state"] == "alive" for w in fabric.cluster()["workers"])


POISON = 4242


def test_a_poisoned_request_fails_alone(hf_models: dict[str, Path], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CRASH_ENV, str(POISON))  # every AW (replacements too) crashes on seed 4242
    with running_fabric(hf_models["qwen3_moe"], tmp_path, aws=2, ews=2) as fabric:
        reference = run_streams(fabric)
        received = [0]
        decoding = threading.Event()
        result: list[list[list[int]]] = []
        runner = threading.Thread(target=lambda: result.append(run_streams(fabric, received, decoding)))
        runner.start()
        assert decoding.wait(60)  # the others run when it arrives
        url = f"http://127.0.0.1:{fabric.port}/v1/completions"
        poisoned = list(iter_stream(url, {**BODY, "prompt": [11, 12, 13], "seed": POISON}))
        runner.join(180)
        assert result and result[0] == reference  # every other request, token-identical
        assert "error" in poisoned[-1], poisoned[-1]
        message = poisoned[-1]["error"]["message"]
        assert "2 attention workers" in message and "not retried" in message
        assert not [e for e in poisoned if "choices" in e]  # it never produced a token
        cluster = wait_for(fabric, "two new AWs", lambda c: sum(
            w["role"] == "attention" and w["state"] == "alive" for w in c["workers"]) == 2)
        assert sum(w["role"] == "attention" and w["state"] == "dead" for w in cluster["workers"]) == 2  # no third
        status, again = post_json(url, {**BODY, "prompt": PROMPTS[0], "stream": False})
        assert status == 200 and again["choices"][0]["finish_reason"] == "length"
        wait_for(fabric, "nothing left running on the AWs", lambda c: all(  # (AW stats come once a second)
            w["stats"].get("running", 1) == 0 for w in c["workers"] if w["role"] == "attention" and w["state"] == "alive"))
    gateway_logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("gateway-*.log"))
    assert "not retried" in gateway_logs  # logged where it was decided


class _Pool:
    """The part of an AwPool that resuming a choice uses: AWs in turn, the orchestrator's verdicts."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.resume = "restore"
        self.next = 0

    def cleared(self, client: object, request_id: str) -> None:
        pass

    async def submit(self, submit: Submit, wait: float = 0.0) -> tuple[object, Pending]:
        self.next += 1
        return SimpleNamespace(worker_id=f"aw-{self.next}"), Pending(submit)


def test_a_request_that_freezes_its_aws_counts_them_once_they_are_declared_dead() -> None:
    """A request that hangs every AW it runs on (a whole process frozen: its gateway finds it silent)
    is moved uncounted, as the AW may only be slow; once the orchestrator declares those AWs dead,
    they count as deaths, and the request is not tried again."""

    async def main() -> tuple[list[int], str]:
        pool = _Pool()
        choice = Choice(0, "r", Submit(request_id="r", prompt_ids=[1, 2], max_tokens=4, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_token_ids=[], ignore_eos=False, output_ids=[]))
        await start_choice(pool, choice)  # type: ignore[arg-type]
        deaths = []
        try:
            for _ in range(4):
                hung = choice.client.worker_id  # type: ignore[union-attr]
                await _resume(pool, choice, f"{hung} is hung", 0.0, death=False)  # type: ignore[arg-type]
                deaths.append(choice.submit.deaths)
                pool.dead.add(hung)  # the orchestrator's verdict, after its lease
        except GenerationError as exc:
            return deaths, str(exc)
        return deaths, ""

    deaths, error = asyncio.run(main())
    assert deaths == [0, 1]  # aw-1: not yet ruled on; aw-1 dead when aw-2 froze too; aw-2 dead at aw-3's
    assert "died before it produced a token" in error


def test_a_slow_aw_found_hung_is_not_counted() -> None:
    async def main() -> int:
        pool = _Pool()
        choice = Choice(0, "r", Submit(request_id="r", prompt_ids=[1, 2], max_tokens=4, temperature=0.0, top_p=1.0, top_k=0, seed=0, stop_token_ids=[], ignore_eos=False, output_ids=[]))
        await start_choice(pool, choice)  # type: ignore[arg-type]
        for _ in range(3):  # each AW only slow: vouched for, never declared dead
            await _resume(pool, choice, "hung", 0.0, death=False)  # type: ignore[arg-type]
        return choice.submit.deaths

    assert asyncio.run(main()) == 0
