"""lm-evaluation-harness, unchanged, against a real fabric: its own `local-completions` model class
scores a small local multiple-choice task (loglikelihood: batched token-id prompts with `echo`,
`logprobs` and `max_tokens: 1`) and runs a generate_until task; its `hf` model class scores the same
task with transformers on the same weights, in this process. Both must agree document by document."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fabric.model.demo import write_demo_model
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


def test_lm_eval_local_completions_scores_as_transformers_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # its dataset cache, not the user's
    import lm_eval
    from lm_eval.tasks import TaskManager

    model = write_demo_model(tmp_path / "demo", arch="mixtral", seed=3)
    tasks = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")))
    with running_fabric(model, tmp_path, aws=2, ews=2, served_model_name="demo") as f:
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
