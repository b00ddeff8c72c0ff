"""lm-eval's `local-completions` model against `sparsegen serve` on loopback: a real client's
loglikelihood requests (`echo: true, logprobs: 1, max_tokens: 1`, prompts as token-id lists),
its tokenizer read through /tokenizer_info, /tokenize and /detokenize (`tokenizer_backend=remote`).

The task is a multiple-choice YAML over a JSONL file written here. The run must succeed and
score, and every per-choice loglikelihood lm-eval logged must equal the one computed offline from
the same random weights by a whole-sequence forward pass (no cache, no engine), so the scores are
the model's and not only well-formed.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import extras

pytestmark = pytest.mark.slow

DOCS = [
    {"question": "The sky is", "choices": ["blue", "green", "loud"], "answer": 0},
    {"question": "Two plus two is", "choices": ["four", "five"], "answer": 0},
    {"question": "Fire is", "choices": ["hot", "cold", "wet"], "answer": 1},
]

TASK = """\
task: sparsegen_tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def _lm_eval_command() -> list[str]:
    extras.require("lm_eval")
    exe = shutil.which("lm_eval")
    if exe is not None:
        return [exe]
    return [sys.executable, "-m", "lm_eval"]


def _offline_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context) by one whole-sequence forward pass of `model`."""
    from sparsegen.models.batch import ForwardBatch

    ctx = tokenizer.encode(context)
    whole = tokenizer.encode(context + continuation)
    assert whole[: len(ctx)] == ctx  # byte tokens: the context's ids are a prefix
    with torch.inference_mode():
        logits = model(torch.tensor(whole), ForwardBatch.whole_sequences([len(whole)]))  # [T, V]
    lp = torch.log_softmax(logits.double(), dim=-1)
    return sum(lp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


def test_lm_eval_local_completions_scores(server, tmp_path):
    cmd = _lm_eval_command()
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "sparsegen_tiny_mc.yaml").write_text(TASK.format(data=data))
    out = tmp_path / "out"
    env = dict(os.environ)
    env.update(
        HF_HOME=str(tmp_path / "hf"),  # datasets' cache of the JSON split, inside the test's folder
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    args = (
        f"base_url={server.url}/v1/completions,model=random-tiny,tokenizer_backend=remote,"
        "num_concurrent=1,max_retries=1,timeout=60"
    )
    run = subprocess.run(
        [*cmd, "--model", "local-completions", "--model_args", args, "--tasks", "sparsegen_tiny_mc",
         "--include_path", str(tasks), "--output_path", str(out), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]

    results = list(out.rglob("results_*.json"))
    assert len(results) == 1, list(out.rglob("*"))
    body = json.loads(results[0].read_text())
    scores = body["results"]["sparsegen_tiny_mc"]
    acc = scores["acc,none"]
    assert isinstance(acc, float) and 0.0 <= acc <= 1.0
    assert body["n-samples"]["sparsegen_tiny_mc"]["effective"] == len(DOCS)

    samples = [json.loads(line) for f in out.rglob("samples_*.jsonl") for line in f.read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(DOCS)))

    # the same random weights, offline (LLM(random="tiny") is seeded: seed=0 builds them alike)
    from sparsegen import LLM

    llm = LLM(random="tiny", max_num_seqs=1)
    correct = 0
    for s in samples:
        doc = DOCS[s["doc_id"]]
        got = [float(r[0][0]) for r in s["resps"]]  # one [loglikelihood, is_greedy] per choice
        pairs = _pairs(s["arguments"])
        assert len(got) == len(pairs) == len(doc["choices"])
        want = [_offline_loglikelihood(llm.engine.model, llm.tokenizer, c, x) for c, x in pairs]
        assert all(math.isfinite(x) and x < 0 for x in got), got
        assert got == pytest.approx(want, abs=1e-3), (got, want)
        correct += max(range(len(got)), key=got.__getitem__) == doc["answer"]
    assert acc == pytest.approx(correct / len(DOCS))


def _pairs(arguments) -> list[tuple[str, str]]:
    """A logged sample's (context, continuation) per choice: lm-eval 0.4 logs
    {"gen_args_i": {"arg_0": context, "arg_1": continuation}}, older releases a list of pairs."""
    if isinstance(arguments, dict):
        keys = sorted(arguments, key=lambda k: int(k.rsplit("_", 1)[-1]))
        return [(arguments[k]["arg_0"], arguments[k]["arg_1"]) for k in keys]
    return [(c, x) for c, x in arguments]
