"""Hostile HTTP input at the gateway: JSON only, a 400 (never a 500) for every malformed body, and a
fair share of the waiting queue per client, so one client's `n` cannot starve the rest."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator

import pytest

from fabric.model.config import ModelConfig
from fabric.model.demo import write_demo_model
from launch.local import Fabric
from tests.conftest import running_fabric
from tests.helpers import post_json, wait_for

OK = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    root = tmp_path_factory.mktemp("http")
    model = write_demo_model(root / "demo", seed=2)  # with a tokenizer: text prompts
    # One request decodes at a time, so choices wait in the queue long enough to be counted.
    with running_fabric(model, root, aws=1, ews=1, gateways=1,
                        max_waiting=32, stream_resume_grace_s=0.0,
                        extra={"attention-worker": ["--max-running", "1"]}) as f:
        yield f


def post(f: Fabric, body: bytes, content_type: str | None = "application/json",
         source: str = "127.0.0.1") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", f.port, timeout=120, source_address=(source, 0))
    try:
        headers = {"Content-Type": content_type} if content_type else {}
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        r = conn.getresponse()
        return r.status, json.loads(r.read() or b"{}")
    finally:
        conn.close()


def test_malformed_bodies_are_400_or_415(fabric: Fabric) -> None:
    ok = json.dumps(OK).encode()
    for ctype in ["text/plain", "application/x-www-form-urlencoded", None]:  # what any web page can post
        status, body = post(fabric, ok, ctype)
        assert status == 415 and body["error"]["code"] == "unsupported_media_type", (ctype, status, body)
    context = ModelConfig.from_dir(fabric.cfg.model or "").max_position
    bad = [
        b"[" * 100_000 + b"]" * 100_000,  # nested past any parser's recursion
        json.dumps({**OK, "stop": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["x"]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}).encode(),
        b'{"prompt": [1, 2], "seed": ' + b"9" * 5000 + b"}",  # a 5000-digit integer
        b'{"prompt": [1, 2], "temperature": NaN}',
        json.dumps({**OK, "stop": ["s" * 65536] * 16}).encode(),  # 16 stop strings of 64 KiB
        json.dumps({**OK, "prompt": [1] * context}).encode(),  # past the model's context
        b'{"prompt": [1, 2], "max_tokens": 1e999}',
        b"\xff\xfe not utf-8",
    ]
    for raw in bad:
        status, body = post(fabric, raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", (raw[:60], status, body)
    status, body = post(fabric, ok)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_a_prompt_past_any_context_is_refused_before_it_is_tokenised(fabric: Fabric) -> None:
    """A 6 MiB text prompt cannot fit a context of 2048 tokens in any tokenization: refused at
    once (tokenizing it took 8 s and held the GIL in bursts). A long one that can fit (100 KiB)
    is tokenized, off the event loop, and served."""
    t0 = time.monotonic()
    status, reply = post(fabric, json.dumps({"prompt": "moe fabric " * (600 << 10), "max_tokens": 1}).encode())
    assert status == 400 and reply["error"]["param"] == "prompt" and "cannot fit" in reply["error"]["message"]
    print(f"refused in {time.monotonic() - t0:.2f} s")
    status, reply = post(fabric, json.dumps({"prompt": "moe fabric " * 9300, "max_tokens": 1}).encode())
    assert status == 400 and reply["error"]["param"] == "max_tokens"  # (tokenized: past the context, by tokens)
    status, reply = post(fabric, json.dumps({"prompt": "moe " * 500, "max_tokens": 1}).encode())
    assert status == 200, reply


def test_one_clients_n_cannot_take_the_whole_queue(fabric: Fabric) -> None:
    """max_waiting 32: one client may hold at most 16 waiting choices. Client A's n=16 stream
    waits (one request decodes at a time); A's next n=16 is refused, B's (another address) is not."""
    url = f"http://127.0.0.1:{fabric.port}/v1/completions"
    first_token, leave = threading.Event(), threading.Event()
    results: dict[str, object] = {}

    def stream_a() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", fabric.port, timeout=300)
        body = {"prompt": [5, 6, 7], "max_tokens": 400, "n": 16, "ignore_eos": True, "stream": True, "seed": 1}
        conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        results["a"] = r.status
        for line in r:
            if line.startswith(b"data: {"):
                first_token.set()
            if leave.is_set():
                break
        conn.close()  # A leaves: its choices are aborted (no resume grace in this fabric)

    a = threading.Thread(target=stream_a)
    a.start()
    try:
        assert first_token.wait(120)  # A's choices are admitted: one decodes, 15 wait
        wait_for(fabric, "A's choices waiting", lambda c: waiting(c) >= 8, 60)
        status, body = post(fabric, json.dumps({**OK, "n": 16}).encode())
        assert status == 429 and "this client" in body["error"]["message"], (status, body)
        # Another client is admitted while A's choices still wait (its stream's headers come at
        # admission; it leaves before its tokens, which would queue behind A's).
        conn = http.client.HTTPConnection("127.0.0.1", fabric.port, timeout=120, source_address=("127.0.0.2", 0))
        conn.request("POST", "/v1/completions", body=json.dumps({**OK, "n": 16, "stream": True}),
                     headers={"Content-Type": "application/json"})
        assert conn.getresponse().status == 200
        conn.close()
        assert a.is_alive()  # A was still streaming when B got in
    finally:
        leave.set()
        a.join(60)
    assert results["a"] == 200
    status, _ = post_json(url, OK)
    assert status == 200


def waiting(cluster: dict) -> int:
    return sum(int(w.get("stats", {}).get("requests_waiting", 0)) for w in cluster["workers"] if w["role"] == "gateway")
