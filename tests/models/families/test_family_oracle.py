"""Each decoder family against transformers itself, on a tiny random float32 checkpoint written by
`save_pretrained` (windows of 8 keys inside a 20-token prompt, biases, llama3 / yarn rope): the
prefill logits agree to float32 rounding, and sparsegen's greedy tokens equal
`model.generate(do_sample=False)` through `sparsegen generate --json` and through `LLM` (both
over the engine's paged KV cache, with prefix chunks for the LLM)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from helpers.extras import require
from helpers.hf_families import FAMILY_CASES, hf_greedy, hf_logits, write_family_checkpoint

from sparsegen.cli import cli
from sparsegen.models import ForwardBatch, load_checkpoint

require("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = [(7 * i + 3) % 90 + 1 for i in range(20)]
NEW = 8


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def family(request, tmp_path_factory):
    folder, hf = write_family_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)
    return request.param, folder, hf, hf_greedy(hf, PROMPT, NEW)


def test_config_model_type_and_windows(family):
    name, folder, hf, _ = family
    model = load_checkpoint(folder, dtype=torch.float32, device="cpu")
    assert model.config.model_type == name == hf.config.model_type
    windows = [layer.heads[0].sliding_window for layer in model.spec.layers]
    want = {"llama": [0, 0], "mistral": [8, 8], "qwen2": [0, 8], "qwen3": [0, 8]}[name]
    assert windows == want


def test_prefill_logits_match_transformers(family):
    _, folder, hf, _ = family
    model = load_checkpoint(folder, dtype=torch.float32, device="cpu")
    got = model(torch.tensor(PROMPT), ForwardBatch.whole_sequences([len(PROMPT)]))  # [T, vocab]
    want = hf_logits(hf, PROMPT)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_cli_greedy_tokens_equal_transformers(family):
    _, folder, _, want = family
    res = CliRunner().invoke(cli, ["generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, PROMPT)),
                                   "--max-tokens", str(NEW), "--ignore-eos", "--json", "--device", "cpu"],
                             catch_exceptions=False)  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["output_ids"] == want


def test_llm_greedy_tokens_equal_transformers(family):
    from sparsegen import LLM, SamplingParams

    _, folder, hf, want = family
    llm = LLM(
        model=folder, device="cpu", dtype="float32", max_num_batched_tokens=16
    )  # the prompt in 2 chunks
    short = PROMPT[:11]
    outs = llm.generate([PROMPT, short], SamplingParams(max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    assert outs[0].token_ids == want
    assert outs[1].token_ids == hf_greedy(hf, short, NEW)
