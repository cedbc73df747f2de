"""Structured outputs and tool calls: the request fields that constrain a completion, as a
`Constraint` the AW enforces while it samples (fabric/grammar.py), and tool calls parsed back
out of a constrained chat completion.

    response_format      {"type": "json_object"} or {"type": "json_schema", "json_schema": {...}}
    structured_outputs   vLLM's: exactly one of json, regex, choice, grammar (both endpoints)
    tools, tool_choice   chat: "required" constrains the output to a list of calls of the tools,
                         a named function to that function's arguments; "auto" and "none" leave
                         the text free (the demo model's chat template defines no tool-call format)
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from fabric import grammar
from fabric.messages.client import Constraint
from gateway.protocol import ApiError

MAX_TOOLS = 64
MAX_PARALLEL_CALLS = 8  # tool calls in one turn (`tool_choice: "required"`): a list that never ends is cut here


@dataclass(frozen=True)
class Tools:
    """How a chat completion's output becomes tool calls: `named` is the one function it calls,
    or "" for a list of calls (`tool_choice: "required"`)."""

    named: str = ""


def parse(body: dict[str, Any], chat: bool) -> tuple[Constraint | None, str, Tools | None]:
    """(the constraint, the parameter it came from, the tool-call mode) of a request body."""
    rf, so = body.get("response_format"), body.get("structured_outputs")
    tools = _tool_constraint(body) if chat else None
    given = [n for n, v in (("response_format", rf), ("structured_outputs", so)) if v is not None]
    if tools is not None and given:
        raise ApiError(400, f"'{given[0]}' cannot be combined with a tool_choice that forces a tool call", given[0])
    if tools is not None:
        return tools[0], "tools", tools[1]
    if len(given) > 1:
        raise ApiError(400, "give 'response_format' or 'structured_outputs', not both", "structured_outputs")
    if rf is not None:
        return _response_format(rf), "response_format", None
    if so is not None:
        return _structured_outputs(so), "structured_outputs", None
    return None, "", None


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError:
            raise ApiError(400, f"'{param}' is not valid JSON", param) from None
    if not isinstance(schema, dict | bool):
        raise ApiError(400, f"'{param}' must be a JSON schema (an object)", param)
    return json.dumps(schema)


def _response_format(rf: Any) -> Constraint | None:
    p = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ApiError(400, "'response_format' must be an object with a 'type'", p)
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js:
            raise ApiError(400, "'response_format.json_schema' must be an object with a 'schema'", p)
        if not isinstance(js.get("strict", False), bool | None):
            raise ApiError(400, "'response_format.json_schema.strict' must be a boolean", p)
        return Constraint("json_schema", _schema_text(js["schema"], p))
    raise ApiError(400, f"unknown response_format type {kind!r}: text, json_object or json_schema", p)


def _structured_outputs(so: Any) -> Constraint:
    p = "structured_outputs"
    if not isinstance(so, dict):
        raise ApiError(400, "'structured_outputs' must be an object", p)
    keys = [k for k in ("json", "regex", "choice", "grammar", "json_object") if so.get(k) not in (None, False)]
    if len(keys) != 1:
        raise ApiError(400, "'structured_outputs' takes exactly one of json, regex, choice, grammar", p)
    key, value = keys[0], so[keys[0]]
    if key == "json":
        return Constraint("json_schema", _schema_text(value, p))
    if key == "json_object":
        return Constraint("json_object")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(x, str) and x for x in value):
            raise ApiError(400, "'structured_outputs.choice' must be a non-empty list of non-empty strings", p)
        return Constraint("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise ApiError(400, f"'structured_outputs.{key}' must be a non-empty string", p)
    return Constraint(key, value)


def _tool_constraint(body: dict[str, Any]) -> tuple[Constraint, Tools] | None:
    """The constraint a forcing `tool_choice` puts on the output; None where the text stays free."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of 1 to {MAX_TOOLS} tools", "tools")
    params: dict[str, Any] = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ApiError(400, "each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}",
                           "tools")
        schema = fn.get("parameters", {"type": "object"})
        if not isinstance(schema, dict):
            raise ApiError(400, f"tool {fn['name']!r}: 'parameters' must be a JSON schema", "tools")
        params[fn["name"]] = schema
    if choice is None or choice in ("auto", "none"):
        return None
    if choice == "required":
        parallel = body.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ApiError(400, "'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
        calls = {"type": "array", "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if parallel else 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
             "required": ["name", "parameters"], "additionalProperties": False}
            for name, schema in params.items()]}}
        return Constraint("json_schema", json.dumps(calls)), Tools()
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, "'tool_choice' must be none, auto, required or {'type': 'function', 'function': "
                            "{'name': ...}}", "tool_choice")
    if fn["name"] not in params:
        raise ApiError(400, f"'tool_choice' names {fn['name']!r}, which is not among the tools", "tool_choice")
    return Constraint("json_schema", json.dumps(params[fn["name"]])), Tools(named=fn["name"])


def tool_calls(tools: Tools, text: str, rid: str) -> list[dict[str, Any]] | None:
    """The OpenAI `tool_calls` of a constrained output; None if it is incomplete (cut by max_tokens)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [(tools.named, value)] if tools.named else [(c["name"], c["parameters"]) for c in value]
    # (ids from the request's: a stream resumed through another gateway gets the same ones)
    return [{"id": "call_" + hashlib.sha256(f"{rid}/{i}".encode()).hexdigest()[:24], "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}} for i, (name, args) in enumerate(calls)]


async def fields(body: dict[str, Any], chat: bool, model_dir: str, vocab_size: int,
                 eos_token_ids: list[int]) -> dict[str, Any]:
    """The `GenParams` fields of a request's constraint, compiled once here, off the loop and in
    bounded time, so that a bad or too costly one is a 400 naming its parameter."""
    constraint, param, tools = parse(body, chat)
    if constraint is None:
        return {}
    if not grammar.available():
        raise ApiError(400, "structured outputs need the grammar engine (pip install 'moe-fabric[structured]')", param)
    try:
        grammars = await asyncio.to_thread(grammar.grammars_for, model_dir, vocab_size, tuple(sorted(eos_token_ids)))
        await grammar.COMPILES.run(grammars.compile, constraint)
    except grammar.ConstraintError as exc:
        raise ApiError(400, str(exc), param) from None
    except grammar.GrammarBusyError as exc:
        raise ApiError(503, str(exc), param, type_="service_unavailable", headers={"Retry-After": "1"}) from None
    except TimeoutError:
        raise ApiError(400, f"the {constraint.kind} is too costly: it did not compile within "
                            f"{grammar.COMPILE_TIMEOUT_S:.0f} s", param) from None
    return {"constraint": constraint, "constraint_param": param,
            "tools_named": None if tools is None else tools.named}
