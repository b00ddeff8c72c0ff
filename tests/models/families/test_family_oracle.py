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
from sparsegen.models.families.rope import DecoderRotary, RopeParams
from sparsegen.spec import HeadSpec

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
    want = {"llama": [0, 0], "mistral": [8, 8], "qwen2": [0, 8], "qwen3": [0, 8]}.get(name, [8, 0])
    assert windows == want
    layer = model.spec.layers[0]
    assert layer.logit_softcap == (hf.config.attn_logit_softcapping or 0.0 if "gemma" in name else 0.0)
    assert layer.learned_sinks == (name == "gpt_oss")


def test_window_softcap_sinks_and_rope_bite(family):
    """The prompt is long enough for the windows, and the weights strong enough for the soft-cap
    and sinks, to change the logits: each turned off (or the rope variant replaced by the plain
    rotary), the model no longer matches."""
    from dataclasses import replace

    name, folder, hf, _ = family
    model = load_checkpoint(folder, dtype=torch.float32, device="cpu")
    want = hf_logits(hf, PROMPT)
    changes = [dict(heads=(HeadSpec(dense=True),) * layer.num_heads) for layer in model.spec.layers[:1]]
    if model.spec.layers[0].logit_softcap:
        changes.append(dict(logit_softcap=0.0))
    if model.spec.layers[0].learned_sinks:
        changes.append(dict(learned_sinks=False))
    if all(layer.heads[0].dense for layer in model.spec.layers):
        changes = changes[1:]  # llama: no window to take away
    if model.config.rope.rope_type != "default":  # llama3, yarn, linear: the plain rotary instead
        plain = DecoderRotary(RopeParams("default", model.config.rope.theta, head_dim=model.config.head_dim))
        rotary, model.rotary = model.rotary, plain
        got = model(torch.tensor(PROMPT), ForwardBatch.whole_sequences([len(PROMPT)]))
        assert (got - want).abs().max() > 1e-3
        model.rotary = rotary
    else:
        assert name in ("mistral", "qwen2", "gemma2")
    assert changes or name == "llama"
    for change in changes:
        for block, layer in zip(model.model.layers, model.spec.layers, strict=True):
            block.self_attn.layer = replace(layer, **change)
        got = model(torch.tensor(PROMPT), ForwardBatch.whole_sequences([len(PROMPT)]))
        assert (got - want).abs().max() > 1e-3, change


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
