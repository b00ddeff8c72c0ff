"""GPU tier: `attn_implementation="sparsegen"` runs sparsegen's kernels (bf16) inside
transformers' window models and agrees with "eager" in float32 within bf16 tolerance."""

from __future__ import annotations

import pytest
import torch
from helpers import extras
from helpers.hf_models import SMALL, write_tiny_checkpoints

pytestmark = pytest.mark.gpu
transformers = extras.require("transformers")
import sparsegen.hf  # noqa: E402, F401 - registers "sparsegen"; needs transformers, the [hf] extra

WINDOW_MODELS = ("mistral", "qwen2", "llama")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_tiny_checkpoints(tmp_path_factory.mktemp("hf-gpu"), head_dim=64, names=WINDOW_MODELS)


@pytest.mark.parametrize("name", WINDOW_MODELS)
def test_bf16_logits_agree_with_eager_float32(checkpoints, name):
    load = transformers.AutoModelForCausalLM.from_pretrained
    eager = load(str(checkpoints[name]), attn_implementation="eager", dtype=torch.float32).cuda().eval()
    ours = load(str(checkpoints[name]), attn_implementation="sparsegen", dtype=torch.bfloat16).cuda().eval()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 300), generator=gen).cuda()
    with torch.no_grad():
        want, got = eager(ids).logits, ours(ids).logits.float()
    assert torch.isfinite(got).all()
    err = (got - want).abs().max() / want.abs().max()
    assert err < 3e-2, f"{name}: relative error {err:.3g}"
    out = ours.generate(ids[:1, :40], attention_mask=torch.ones_like(ids[:1, :40]), max_new_tokens=8,
                        do_sample=False)  # fmt: skip
    assert out.shape == (1, 48)  # decode through transformers' cache runs the kernel with q_len < k_len
