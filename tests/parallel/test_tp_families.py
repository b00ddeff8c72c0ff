"""Tensor parallelism for every decoder family on the CPU (gloo, 2 ranks): on each family's tiny
random transformers checkpoint (windows of 8 keys inside the prompts, biases, q/k norms, soft-caps,
sinks, gpt-oss's experts), greedy and seeded tokens equal the one-process engine's in float32
(through a chunked prefill over a cached prefix), and the ranks' last-position logits equal the
one-process model's to float32 rounding; `sparsegen generate --tp 2` gives transformers' own
greedy tokens for gpt-oss (experts, sinks, windows). Each test starts one 2-rank engine (spawned processes:
several seconds each on a small machine)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers.extras import require
from helpers.hf_families import FAMILY_CASES, hf_greedy, write_family_checkpoint
from helpers.tp import last_logits, rank_facts

from sparsegen.cli import cli
from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import ForwardBatch, load_checkpoint
from sparsegen.parallel.source import ModelSource

require("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]

PROMPTS = [[(7 * i + 3) % 90 + 1 for i in range(20)], [5, 6, 7], [(11 * i) % 95 for i in range(13)]]
ENGINE = dict(page_size=16, max_num_batched_tokens=16)  # the 20-token prompt: a chunk over a prefix
PARAMS = [
    SamplingParams(max_tokens=8, ignore_eos=True),
    SamplingParams(max_tokens=8, ignore_eos=True),
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, top_k=20, seed=7),
]


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_two_ranks_generate_the_one_process_tokens(tmp_path, family):
    folder, _ = write_family_checkpoint(tmp_path / "ckpt", family)
    whole = load_checkpoint(folder, dtype=torch.float32, device="cpu")
    want = [r.token_ids for r in LLMEngine(whole, **ENGINE).generate(PROMPTS, PARAMS)]
    with torch.inference_mode():
        want_logits = whole(torch.tensor(PROMPTS[0]), ForwardBatch.whole_sequences([len(PROMPTS[0])]))[-1]
    source = ModelSource(model_dir=str(folder))
    with LLMEngine(source, tensor_parallel_size=2, device="cpu", **ENGINE) as engine:
        got = [r.token_ids for r in engine.generate(PROMPTS, PARAMS)]
        logits = engine.executor.call(last_logits, PROMPTS[0])
        facts = engine.executor.call(rank_facts)
    assert got == want
    assert len({tuple(t) for t in want}) > 1  # the prompts lead to different tokens
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    for f in facts:  # each rank: its 2 query heads, its 1 KV head cached, half the vocabulary
        assert (f["num_heads"], f["kv_cache_shape"][2], f["lm_head_rows"]) == (2, 1, 48)
        assert f["offsets"] == [offs[2 * f["rank"] : 2 * f["rank"] + 2] for offs in f["global_offsets"]]


def test_generate_tp2_cli_equals_transformers_generate(tmp_path):
    folder, hf = write_family_checkpoint(tmp_path / "ckpt", "gpt_oss")
    want = hf_greedy(hf, PROMPTS[0], 8)
    args = ["generate", "--model", str(folder), "--tp", "2", "--device", "cpu", "--dtype", "fp32",
            "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-tokens", "8", "--temperature", "0",
            "--json"]  # fmt: skip
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["output_ids"] == want
