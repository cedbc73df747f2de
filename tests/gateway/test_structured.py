"""Structured outputs and tool calls against a real fabric serving the demo model (a real
tokenizer), through the official openai client: every output parses and validates against its
schema, at temperature 0 and seeded; a bad schema, regex or grammar is a 400 naming its parameter;
and constrained streams come through an AW's and an EW's SIGINT token-identical and valid."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

import pytest
import requests
from pydantic import BaseModel, Field

from fabric import grammar
from fabric.model.demo import write_demo_model
from launch.local import Fabric
from tests.conftest import running_fabric
from tests.load import PROMPTS, kill_mid_decode

pytestmark = pytest.mark.skipif(not grammar.available(), reason="needs the grammar engine (the structured extra)")


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Literal["cat", "dog", "owl"]
    indoor: bool


class Weather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]


TOOLS = {"get_weather": Weather, "adopt": Pet}
T = TypeVar("T")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fabric]:
    root = tmp_path_factory.mktemp("structured")
    model = write_demo_model(root / "demo", arch="mixtral", seed=3)
    with running_fabric(model, root, aws=2, ews=2, served_model_name="demo") as f:
        yield f


def client(f: Fabric):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{f.port}/v1", api_key="unused", max_retries=0, timeout=120)


SAMPLING = [{"temperature": 0.0}, *({"temperature": 1.0, "seed": s} for s in (11, 12, 13))]


def concurrently(fn: Callable[..., T], *args_list: tuple[Any, ...]) -> list[T]:
    """`fn` over every argument tuple, the requests in flight together (the fabric batches them)."""
    with ThreadPoolExecutor(max_workers=len(args_list)) as pool:
        return list(pool.map(lambda a: fn(*a), args_list))


def test_a_pydantic_response_format_parses_every_time(demo: Fabric) -> None:
    c = client(demo)

    def parse(i: int, kw: dict[str, Any]) -> None:
        r = c.chat.completions.parse(model="demo", messages=[{"role": "user", "content": f"Describe pet {i}."}],
                                     response_format=Pet, max_tokens=200, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Pet)
        Pet.model_validate_json(choice.message.content or "")

    concurrently(parse, *((i, kw) for i in range(4) for kw in SAMPLING))


def test_tool_choice_required_and_named_return_valid_tool_calls(demo: Fabric) -> None:
    import openai

    c = client(demo)
    tools = [openai.pydantic_function_tool(m, name=n) for n, m in TOOLS.items()]

    def required(i: int, kw: dict[str, Any]) -> None:
        r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": f"Help me, {i}."}],
                                      tools=tools, tool_choice="required", max_tokens=800, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        assert len(choice.message.tool_calls) <= 8  # (MAX_PARALLEL_CALLS)
        for call in choice.message.tool_calls:
            TOOLS[call.function.name].model_validate_json(call.function.arguments)

    concurrently(required, *((i, kw) for i in range(3) for kw in SAMPLING))
    r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "One call."}], tools=tools,
                                  tool_choice="required", parallel_tool_calls=False, max_tokens=200, temperature=0)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].message.tool_calls or []) == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Weather?"}], tools=tools,
                                  tool_choice=named, max_tokens=200, seed=5)  # type: ignore[arg-type]
    calls = r.choices[0].message.tool_calls
    assert calls and len(calls) == 1 and calls[0].function.name == "get_weather"
    Weather.model_validate_json(calls[0].function.arguments)
    # Streamed: the calls come as a delta once they are complete, with the same arguments.
    chunks = list(c.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Weather?"}],
                                            tools=tools, tool_choice=named, max_tokens=200, seed=5, stream=True))  # type: ignore[arg-type]
    streamed = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
    assert [tc.function.arguments for tc in streamed] == [calls[0].function.arguments]  # type: ignore[union-attr]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_regex_choice_and_grammar_on_completions(demo: Fabric) -> None:
    url = f"http://127.0.0.1:{demo.port}/v1/completions"
    for so, check in [({"regex": "[a-c]{2,5}x"}, lambda t: len(t) in range(3, 7) and t.endswith("x")),
                      ({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
                      ({"grammar": 'root ::= "(" [0-9] ("+" [0-9])? ")"'}, lambda t: t.startswith("(") and t.endswith(")"))]:
        for seed in (1, 2, 3):
            r = requests.post(url, json={"model": "demo", "prompt": "Say:", "max_tokens": 30, "seed": seed,
                                         "structured_outputs": so}, timeout=120).json()
            assert r["choices"][0]["finish_reason"] == "stop" and check(r["choices"][0]["text"]), (so, r)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such"}}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                    "function": {"name": "g"}}},
     "tool_choice"),
])
def test_a_bad_constraint_is_a_400_naming_its_parameter(demo: Fabric, body: dict[str, object], param: str) -> None:
    r = requests.post(f"http://127.0.0.1:{demo.port}/v1/chat/completions",
                      json={"model": "demo", "messages": [{"role": "user", "content": "hi"}], **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


SCHEMA = Pet.model_json_schema()
CONSTRAINED = {"max_tokens": 120, "temperature": 0.8, "seed": 11, "return_token_ids": True, "stream": True,
               "structured_outputs": {"json": SCHEMA}}


@pytest.mark.parametrize("victim", ["attention-worker-0", "expert-worker-1"])
def test_constrained_streams_survive_a_sigint_identical_and_valid(demo: Fabric, victim: str) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(demo.cfg.model) / "tokenizer.json"))
    reference, outputs, _ = kill_mid_decode(demo, victim, signal.SIGINT, body=CONSTRAINED)
    assert outputs == reference  # 0 lost, token-identical to the failure-free run
    for ids in outputs:
        Pet.model_validate(json.loads(tok.decode(ids)))
    assert len(outputs) == len(PROMPTS)
