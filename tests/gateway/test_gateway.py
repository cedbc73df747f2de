"""The OpenAI-compatible gateway driven as chat clients drive it: the official `openai` client,
raw HTTP for every error case, disconnects, and many concurrent streams."""

from __future__ import annotations

import asyncio
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest

from fabric.faults import SLOW_ENV
from fabric.model.demo import write_demo_model
from launch.config import ServeConfig
from launch.local import Fabric
from tests.helpers import free_port, iter_events, poll_until, wait_for

KEY = "test-key-123"
GRACE = 1.0


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    root = tmp_path_factory.mktemp("gw")
    model = write_demo_model(root / "demo", arch="qwen3_moe", seed=1)
    # One gateway: /metrics is per gateway process. A short resume grace, so the tests see it end. Every AW step 3 ms
    # longer (the test-only slow-steps hook): a stream as long as the context allows outlasts the grace however fast
    # the machine decodes the tiny model (without it, ~2000 tokens took ~1 s on a fast day).
    cfg = ServeConfig(model=str(model), attention_workers=2, expert_workers=2, gateways=1, transport="tcp",
                      port=free_port(), api_key=KEY, served_model_name="demo", ready_timeout=180,
                      stream_resume_grace_s=GRACE)
    logs = root / "logs"
    logs.mkdir()
    slow = {f"attention-worker-{i}": {SLOW_ENV: "0,3"} for i in range(cfg.attention_workers)}
    f = Fabric(cfg, log_dir=str(logs), extra_env=slow)
    try:
        f.start()
        f.wait_ready(180)
        yield f
    finally:
        f.stop()


def client(f: Fabric) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{f.port}/v1", api_key=KEY, max_retries=0, timeout=120)


def raw(f: Fabric, path: str, body: bytes | str | None, method: str = "POST", key: str | None = KEY,
        headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], dict]:
    data = body.encode() if isinstance(body, str) else body
    h = {"Content-Type": "application/json", **(headers or {})}
    if key:
        h["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{f.port}{path}", data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read() or b"{}")


def test_chat_completion_with_the_openai_client(fabric: Fabric) -> None:
    c = client(fabric)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    r = c.chat.completions.create(model="demo", messages=msgs, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    text = r.choices[0].message.content
    # streaming gives the same greedy text, role first, then content, finish, usage, [DONE]
    chunks = list(c.chat.completions.create(model="demo", messages=msgs, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert r.usage.prompt_tokens == chunks[-1].usage.prompt_tokens > 10


def test_text_completion_n_stop_and_logprobs(fabric: Fabric) -> None:
    c = client(fabric)
    base = c.completions.create(model="demo", prompt="Serving language models", max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True})
    text = base.choices[0].text
    assert len(text) > 4
    stop = text[len(text) // 2: len(text) // 2 + 3]
    cut = c.completions.create(model="demo", prompt="Serving language models", max_tokens=24, temperature=0,
                               stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and stop not in cut.choices[0].text
    assert text.startswith(cut.choices[0].text)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="demo", prompt="Serving language models", max_tokens=24, temperature=0, stop=[stop], stream=True,
        extra_body={"ignore_eos": True}))
    assert streamed == cut.choices[0].text  # never emits any part of the stop string
    many = c.completions.create(model="demo", prompt="Serving", max_tokens=8, temperature=1.0, n=3, seed=7,
                                logprobs=2, extra_body={"ignore_eos": True})
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2] and many.usage.completion_tokens == 24
    lp = many.choices[0].logprobs
    assert len(lp.token_logprobs) == 8 and all(v <= 0 for v in lp.token_logprobs) and len(lp.top_logprobs[0]) == 2
    again = c.completions.create(model="demo", prompt="Serving", max_tokens=8, temperature=1.0, n=3, seed=7,
                                 extra_body={"ignore_eos": True})
    assert [ch.text for ch in again.choices] == [ch.text for ch in many.choices]  # seeded: reproducible
    chat = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     logprobs=True, top_logprobs=3, temperature=0)
    entry = chat.choices[0].logprobs.content[0]
    assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob >= entry.logprob


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/chat/completions", "{not json", 400, None),
        ("/v1/chat/completions", json.dumps({"model": "demo"}), 400, "messages"),
        ("/v1/chat/completions", json.dumps({"messages": []}), 400, "messages"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), 400, "messages[0].role"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}), 400, "messages[0].content"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": 7}), 400, "temperature"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "top_p": 0}), 400, "top_p"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 0}), 400, "n"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}), 400, "max_tokens"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}), 400, "max_tokens"),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}), 404, "model"),
        ("/v1/completions", json.dumps({"prompt": "x" * 30000, "max_tokens": 2000}), 400, "max_tokens"),
        ("/v1/completions", json.dumps({"prompt": [1, 2, -5]}), 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": "x", "stream": "yes"}), 400, "stream"),
        ("/v1/completions", json.dumps([1, 2, 3]), 400, None),
        ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0}), 400, "max_tokens"),  # (0: echo only)
        ("/v1/completions", json.dumps({"prompt": "x", "echo": 1}), 400, "echo"),
        ("/v1/completions", json.dumps({"prompt": "x", "prompt_logprobs": 21}), 400, "prompt_logprobs"),
    ],
)
def test_bad_requests_get_openai_errors(fabric: Fabric, path: str, body: str, status: int, param: str | None) -> None:
    code, _, err = raw(fabric, path, body)
    assert code == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["param"] == param


def test_auth_body_cap_and_the_server_still_serves(fabric: Fabric) -> None:
    ok = json.dumps({"prompt": "hi", "max_tokens": 2})
    assert raw(fabric, "/v1/completions", ok, key=None)[0] == 401
    assert raw(fabric, "/v1/completions", ok, key="wrong")[0] == 401
    # 413 from the Content-Length alone: the body is never read
    with socket.create_connection(("127.0.0.1", fabric.port), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {1 << 30}\r\n\r\n".encode())
        reply = s.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 413") and '"request_too_large"' in reply
    assert raw(fabric, "/health", None, method="GET")[0] == 200
    code, _, body = raw(fabric, "/v1/completions", ok)
    assert code == 200 and body["usage"]["completion_tokens"] >= 1


def metric(f: Fabric, name: str) -> float:
    req = urllib.request.Request(f"http://127.0.0.1:{f.port}/metrics", headers=f.admin_headers())
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_disconnect_mid_stream_frees_everything(fabric: Fabric) -> None:
    """A stream whose client vanished keeps running detached for its resume grace (its KV held),
    then is aborted and every KV block freed."""
    def stats() -> list[dict]:
        workers = fabric.cluster()["workers"]
        return [w["stats"] for w in workers if w["role"] == "attention" and w["state"] == "alive"]

    def kv_used() -> int:
        return sum(s.get("kv_blocks_used", 0) for s in stats())

    expired = sum(s.get("expired", 0) for s in stats())

    # As long as the context allows (over 6 s with the fixture's slow steps): it must outlast the grace, which starts
    # when the gateway finds its client gone, or it finishes instead of expiring.
    body = json.dumps({"prompt": "Serving language models", "max_tokens": 2000, "ignore_eos": True, "stream": True})
    with socket.create_connection(("127.0.0.1", fabric.port), timeout=30) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}".encode())
        seen = b""
        while seen.count(b"data: ") < 3:
            seen += s.recv(65536)
        assert metric(fabric, "moe_fabric_requests_running") == 1
        assert poll_until(lambda: kv_used() > 0)  # the AW holds its KV blocks while it streams
    assert poll_until(lambda: metric(fabric, "moe_fabric_requests_running") == 0)
    assert poll_until(lambda: sum(s.get("detached", 0) for s in stats()) == 1)  # kept for a resume
    assert kv_used() > 0
    assert poll_until(lambda: kv_used() == 0)  # past its grace the AW dropped it
    assert sum(s.get("expired", 0) for s in stats()) == expired + 1
    assert metric(fabric, "moe_fabric_kv_blocks_free") > 0


def _per_choice(payloads: list[dict]) -> dict[object, list]:
    """Each choice's chunks in order (choices interleave as they come), and the usage."""
    out: dict[object, list] = {}
    for p in payloads:
        for c in p["choices"]:
            out.setdefault(c["index"], []).append(c)
        if p.get("usage"):
            out.setdefault("usage", []).append(p["usage"])
    return out


@pytest.mark.parametrize("wait_out_grace", [False, True])
def test_a_broken_stream_resumes_exactly_with_last_event_id(fabric: Fabric, wait_out_grace: bool) -> None:
    """A client whose stream broke sends the request again with Last-Event-ID and gets exactly the
    events after it: from the AW that kept running it, or, past its grace, generated again."""
    url = f"http://127.0.0.1:{fabric.port}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "demo", "messages": [{"role": "user", "content": "resume me"}], "max_tokens": 24, "n": 2,
            "temperature": 0.9, "seed": 7, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    full = [p for _, p in iter_events(url, body, headers=auth)]
    assert len(full) == 2 + 2 * 24 + 1  # two role events, a chunk per token, usage
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Accept": "text/event-stream", **auth})
    got, last = [], None
    with urllib.request.urlopen(req, timeout=60) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("id: "):
                last = line[4:]
            elif line.startswith("data: "):
                got.append(json.loads(line[6:]))
                if len(got) == 15:
                    break  # the client goes away mid-stream
    assert last is not None and last.startswith(got[0]["id"] + ":7:")
    if wait_out_grace:  # the AW drops it after its grace: the resume generates it again (same seed, same tokens)
        def kept(c: dict) -> int:
            return sum(w["stats"].get("parked", 0) + w["stats"].get("detached", 0) for w in c["workers"]
                       if w["role"] == "attention" and w["state"] == "alive")
        wait_for(fabric, "the AW keeping the stream", lambda c: kept(c) > 0)
        wait_for(fabric, "the AW dropping it past its grace", lambda c: kept(c) == 0)
    rest = [p for _, p in iter_events(url, body, headers={**auth, "Last-Event-ID": last})]
    assert _per_choice(got + rest) == _per_choice(full) and len(got + rest) == len(full)
    assert {p["id"] for p in got + rest} == {got[0]["id"]}  # the same request, resumed
    code, _, err = raw_post(fabric, "/v1/chat/completions", body, {"Last-Event-ID": "cmpl-zz:1:2"})
    assert code == 400 and err["error"]["param"] == "Last-Event-ID"


def raw_post(f: Fabric, path: str, body: dict, headers: dict[str, str]) -> tuple[int, dict[str, str], dict]:
    return raw(f, path, json.dumps(body), headers=headers)


def test_64_concurrent_streams_are_complete_and_well_formed(fabric: Fabric) -> None:
    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str, bool]:
        body = {"model": "demo", "messages": [{"role": "user", "content": f"question {i}"}], "max_tokens": 10,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        tokens, finish, done = 0, "", False
        async with session.post(f"http://127.0.0.1:{fabric.port}/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {KEY}"}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.strip()
                if not line or line.startswith(b"id: "):
                    continue
                assert line.startswith(b"data: "), line
                if line == b"data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for ch in chunk["choices"]:
                    finish = ch["finish_reason"] or finish
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return tokens, finish, done

    async def run() -> list[tuple[int, str, bool]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(*(one(session, i) for i in range(64)))

    results = asyncio.run(run())
    assert results == [(10, "length", True)] * 64
    assert metric(fabric, "moe_fabric_requests_finished_total") >= 64
    assert metric(fabric, "moe_fabric_time_to_first_token_seconds_count") >= 64


def test_health_and_metrics_names(fabric: Fabric) -> None:
    code, _, body = raw(fabric, "/health", None, method="GET", key=None)
    assert code == 200 and body == {"status": "ok"}  # the details are for insiders
    with pytest.raises(urllib.error.HTTPError) as err:  # /metrics too: not --public-metrics
        urllib.request.urlopen(f"http://127.0.0.1:{fabric.port}/metrics", timeout=10)
    assert err.value.code == 401
    req = urllib.request.Request(f"http://127.0.0.1:{fabric.port}/health", headers=fabric.admin_headers())
    with urllib.request.urlopen(req, timeout=10) as r:
        assert json.loads(r.read())["checkpointing"] == "on"
    req = urllib.request.Request(f"http://127.0.0.1:{fabric.port}/metrics", headers=fabric.admin_headers())
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    for name in ["moe_fabric_requests_running", "moe_fabric_requests_waiting", "moe_fabric_requests_finished_total",
                 "moe_fabric_request_errors_total", "moe_fabric_time_to_first_token_seconds_bucket",
                 "moe_fabric_time_between_tokens_seconds_bucket", "moe_fabric_e2e_latency_seconds_bucket",
                 "moe_fabric_generated_tokens_total", "moe_fabric_kv_blocks_used", "moe_fabric_kv_blocks_free",
                 "moe_fabric_expert_tokens_processed"]:
        assert name in text, name


def test_every_worker_freezes_its_heap_once_it_serves(fabric: Fabric) -> None:
    """What a worker holds once it serves (modules, weights, tables) is out of the cyclic GC's reach: a full
    collection walks ~200,000 objects of a torch process, ~0.1 s with the GIL held (fabric/process.py)."""
    def reports() -> list[dict[str, Any]]:
        return [w["stats"] for w in fabric.cluster()["workers"] if w["state"] == "alive" and w["role"] != "orchestrator"]

    # frozen by the fork server, then by the role runtime once its service started and at ready
    assert poll_until(lambda: len(reports()) >= 4 and all(r.get("gc_frozen", 0) > 10_000 and r["gc_freezes"] >= 3
                                                          for r in reports()))
    assert all(r["gc_full_collections"] >= 0 for r in reports())


def test_tokenize_and_detokenize_as_vllm_serves_them(fabric: Fabric) -> None:
    """vLLM's /tokenize and /detokenize (lm-eval and other clients call them when present): the
    model's own tokenizer, the API key, OpenAI-shaped errors; the ids serve as a prompt."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{fabric.cfg.model}/tokenizer.json")
    text = "The quick brown fox"
    status, _, body = raw(fabric, "/tokenize", json.dumps({"prompt": text, "add_special_tokens": False}))
    assert status == 200, body
    assert body["tokens"] == tok.encode(text, add_special_tokens=False).ids
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] > 0
    status, _, default = raw(fabric, "/tokenize", json.dumps({"prompt": text}))
    assert status == 200 and default["tokens"] == tok.encode(text, add_special_tokens=True).ids
    status, _, chat = raw(fabric, "/tokenize", json.dumps({"messages": [{"role": "user", "content": text}]}))
    assert status == 200 and chat["count"] > len(body["tokens"])  # the chat template's tokens around it
    status, _, back = raw(fabric, "/detokenize", json.dumps({"tokens": body["tokens"]}))
    assert status == 200 and back["prompt"] == tok.decode(body["tokens"], skip_special_tokens=False)
    # The ids are what the gateway generates from: the same completion either way.
    same = [raw(fabric, "/v1/completions", json.dumps({"model": "demo", "prompt": p, "max_tokens": 4,
                                                       "temperature": 0}))[2]["choices"][0]["text"]
            for p in (text, body["tokens"])]
    assert same[0] == same[1]
    for path, bad, code in (("/tokenize", {"prompt": 5}, 400), ("/detokenize", {"tokens": [10**9]}, 400),
                            ("/detokenize", {"tokens": "abc"}, 400), ("/tokenize", {"prompt": "x", "model": "no"}, 404)):
        status, _, err = raw(fabric, path, json.dumps(bad))
        assert status == code and "error" in err, (path, bad, err)
    assert raw(fabric, "/tokenize", json.dumps({"prompt": text}), key=None)[0] == 401


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_in_one_completion_request(fabric: Fabric, stream: bool) -> None:
    """`prompt` as a list of prompts (strings and token-id lists mixed, as lm-eval and vLLM's
    clients send them): `n` choices per prompt, index = prompt * n + j, each what the prompt alone
    gives (greedy), usage over every prompt."""
    prompts: list[Any] = ["Once upon a time", [5, 9, 23, 47], "The sky is", [100, 3, 7]]
    single = [raw(fabric, "/v1/completions", json.dumps({"model": "demo", "prompt": p, "max_tokens": 6,
                                                         "temperature": 0, "return_token_ids": True}))[2]
              for p in prompts]
    body = {"model": "demo", "prompt": prompts, "max_tokens": 6, "temperature": 0, "n": 2, "return_token_ids": True}
    if stream:
        got: dict[int, list[int]] = {}
        usage = None
        for _, ev in iter_events(f"http://127.0.0.1:{fabric.port}/v1/completions",
                                 {**body, "stream": True, "stream_options": {"include_usage": True}},
                                 headers={"Authorization": f"Bearer {KEY}"}):
            for ch in ev.get("choices", []):
                got.setdefault(ch["index"], []).extend(ch.get("token_ids") or [])
            usage = ev.get("usage") or usage
        by_index = got
    else:
        status, _, out = raw(fabric, "/v1/completions", json.dumps(body))
        assert status == 200, out
        assert [c["index"] for c in out["choices"]] == list(range(8))
        by_index = {c["index"]: c["token_ids"] for c in out["choices"]}
        assert [c["prompt_token_ids"] for c in out["choices"][::2]] == [s["prompt_token_ids"] for s in single]
        usage = out["usage"]
    assert sorted(by_index) == list(range(8))
    for i, s in enumerate(single):
        assert by_index[2 * i] == by_index[2 * i + 1] == s["choices"][0]["token_ids"]
    assert usage is not None and usage["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in single)
    assert usage["completion_tokens"] == 8 * 6
    status, _, err = raw(fabric, "/v1/completions", json.dumps({"model": "demo", "prompt": ["a"] * 65}))
    assert status == 400 and err["error"]["param"] == "prompt"
    status, _, err = raw(fabric, "/v1/completions", json.dumps({"model": "demo", "prompt": ["a", [], "b"]}))
    assert status == 400


def test_a_client_that_does_not_speak_sse_gets_only_data_lines(fabric: Fabric) -> None:
    """Event ids go to clients that ask for SSE (`Accept: text/event-stream`, as SSE clients and
    resuming ones do); a client that reads every line as `data: <JSON>` (vLLM's benchmark) gets
    nothing else."""
    body = json.dumps({"model": "demo", "prompt": "Hello", "max_tokens": 5, "stream": True}).encode()
    lines = {}
    for accept in ("", "text/event-stream"):
        h = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}", **({"Accept": accept} if accept else {})}
        req = urllib.request.Request(f"http://127.0.0.1:{fabric.port}/v1/completions", data=body, headers=h)
        with urllib.request.urlopen(req, timeout=60) as r:
            lines[accept] = [x.decode().strip() for x in r if x.strip()]
    assert lines[""] and all(x.startswith("data: ") for x in lines[""])
    assert lines[""][-1] == "data: [DONE]" and all(json.loads(x[6:]) for x in lines[""][:-1])
    assert any(x.startswith("id: ") for x in lines["text/event-stream"])
