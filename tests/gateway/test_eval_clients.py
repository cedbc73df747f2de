"""Evaluation clients, unchanged, against a real fabric serving the demo model (a real tokenizer).
lm-evaluation-harness: its own `local-completions` model class scores a small local multiple-choice
task (loglikelihood: batched token-id prompts with `echo`, `logprobs` and `max_tokens: 1`) and runs
a generate_until task; its `hf` model class scores the same tasks with transformers on the same
weights, in this process; both must agree document by document. The official `openai` client reads
echoed prompts and their logprobs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from fabric.model.demo import write_demo_model
from launch.local import Fabric
from tests.conftest import running_fabric

CHOICE_TASK = """task: fabric_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
"""
GEN_TASK = """task: fabric_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""
DOCS = [("Q: What is 9 plus 3?\nA:", [" 12", " 13", " 29 or so"], 0),
        ("Q: Name a colour.\nA:", [" red", " the sea", " 7"], 0),
        ("Q: What comes after Monday?\nA:", [" Sunday", " Tuesday", " a long weekend"], 1)]


def write_tasks(root: Path) -> Path:
    root.mkdir()
    (root / "choice.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "label": y}) + "\n"
                                               for q, c, y in DOCS))
    (root / "gen.jsonl").write_text("".join(json.dumps({"question": q, "answer": c[y]}) + "\n" for q, c, y in DOCS))
    (root / "fabric_choice.yaml").write_text(CHOICE_TASK.format(data=root / "choice.jsonl"))
    (root / "fabric_gen.yaml").write_text(GEN_TASK.format(data=root / "gen.jsonl"))
    return root


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fabric, Path]]:
    root = tmp_path_factory.mktemp("eval")
    model = write_demo_model(root / "demo", arch="mixtral", seed=3)
    with running_fabric(model, root, aws=2, ews=2, served_model_name="demo") as f:
        yield f, model


def test_lm_eval_local_completions_scores_as_transformers_does(demo: tuple[Fabric, Path], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # its dataset cache, not the user's
    import lm_eval
    from lm_eval.tasks import TaskManager

    f, model = demo
    # (only this test's tasks: indexing lm-eval's thousands of bundled ones takes ~14 s here)
    tasks = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")), include_defaults=False)
    served = lm_eval.simple_evaluate(
        model="local-completions", tasks=["fabric_choice", "fabric_gen"], task_manager=tasks, log_samples=True,
        model_args={"model": "demo", "base_url": f"http://127.0.0.1:{f.port}/v1/completions",
                    "tokenizer": str(model), "tokenizer_backend": "huggingface", "num_concurrent": 2,
                    "max_retries": 1, "batch_size": 4})
    local = lm_eval.simple_evaluate(model="hf", tasks=["fabric_choice", "fabric_gen"], task_manager=tasks, device="cpu",
                                    log_samples=True, model_args={"pretrained": str(model), "dtype": "float32"})
    assert served is not None and local is not None
    got = served["samples"]["fabric_choice"]
    want = {s["doc_id"]: s for s in local["samples"]["fabric_choice"]}
    assert len(got) == len(DOCS)
    for s in got:
        ref = want[s["doc_id"]]
        assert [a for a in s["arguments"]] == [a for a in ref["arguments"]]
        for (lp, greedy), (lp_ref, greedy_ref) in zip([r[0] for r in s["resps"]], [r[0] for r in ref["resps"]]):
            assert abs(float(lp) - float(lp_ref)) < 1e-3, (s["doc_id"], lp, lp_ref)
            assert greedy == greedy_ref
    assert served["results"]["fabric_choice"]["acc,none"] == local["results"]["fabric_choice"]["acc,none"]
    gen = {s["doc_id"]: s["resps"] for s in served["samples"]["fabric_gen"]}
    assert gen == {s["doc_id"]: s["resps"] for s in local["samples"]["fabric_gen"]}, "greedy generations differ"


def test_echo_and_prompt_scores_through_the_openai_client(demo: tuple[Fabric, Path]) -> None:
    """`echo` gives the prompt's text back before the completion, and with `logprobs` its tokens'
    logprobs (the first null), all parsed by the official client; `max_tokens: 0` scores only."""
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{demo[0].port}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "Serving language models"
    plain = c.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0, logprobs=2)
    echoed = c.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0, logprobs=2, echo=True)
    scored = c.completions.create(model="demo", prompt=prompt, max_tokens=0, temperature=0, logprobs=2, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert scored.choices[0].text == prompt and scored.usage is not None and scored.usage.completion_tokens == 0
    lp, prompt_lp, plain_lp = echoed.choices[0].logprobs, scored.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and prompt_lp is not None and plain_lp is not None
    n = len(prompt_lp.tokens or [])
    assert n == scored.usage.prompt_tokens and "".join(prompt_lp.tokens or []) == prompt
    assert (lp.token_logprobs or [])[:n] == prompt_lp.token_logprobs and (lp.token_logprobs or [])[n:] == plain_lp.token_logprobs
    assert (prompt_lp.token_logprobs or [])[0] is None and all(x <= 0 for x in (prompt_lp.token_logprobs or [])[1:])
    for top, own in zip((prompt_lp.top_logprobs or [])[1:], (prompt_lp.token_logprobs or [])[1:]):
        # (two top tokens whose texts are the same, e.g. byte fragments, share a key: as in OpenAI's and vLLM's)
        assert 1 <= len(top) <= 2 and max(top.values()) >= own
    tokens = [t for ch in c.completions.create(model="demo", prompt=prompt, max_tokens=5, temperature=0, echo=True,
                                                stream=True) for t in ch.choices[0].text]
    assert "".join(tokens) == echoed.choices[0].text
