"""Each decoder family on the GPU in bf16 against transformers (the same tiny random checkpoint):
sparsegen's bf16 prefill logits, through the compiled kernels, are as close to transformers' float32
logits as transformers' own bf16 logits are (within 1.5x of that error, plus a bf16 ulp-scale
slack). Measuring against float32 rather than against transformers' bf16 matters for gpt-oss: a
router near-tie flips an expert under bf16 rounding in either implementation, so two bf16 runs
can differ by more than either differs from the float32 truth. A layer that
needs an attention feature or head_dim the kernels do not declare yet is refused with the typed
error naming it, before anything runs (and the reference attention, on the GPU, still matches)."""

from __future__ import annotations

import pytest
import torch
from helpers.extras import require
from helpers.hf_families import FAMILY_CASES, hf_logits, write_family_checkpoint

from sparsegen.errors import ImplUnavailableError
from sparsegen.kernels.families.decode import CudaDecode
from sparsegen.kernels.families.prefill_tl import TritonPrefill
from sparsegen.models import ForwardBatch, load_checkpoint

pytestmark = pytest.mark.gpu
PROMPT = [(7 * i + 3) % 90 + 1 for i in range(40)]


def missing_features(spec) -> set[str]:
    """What the spec's layers use that the prefill or decode kernels do not declare."""
    out = set()
    for fam in (TritonPrefill, CudaDecode):
        for layer in spec.layers:
            out |= set(layer.features) - set(fam.features)
            if layer.head_dim not in fam.head_dims:
                out.add("head_dim")
    return out


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def as_close_as_transformers_bf16(got: torch.Tensor, want32: torch.Tensor, hf16: torch.Tensor) -> None:
    """`got` (sparsegen bf16) vs the float32 truth, bounded by transformers' own bf16 error."""
    bound = 1.5 * max_err(hf16, want32) + 1e-2 * want32.abs().max().item()
    err = max_err(got, want32)
    assert err <= bound, (err, bound)


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_family_prefill_logits_on_the_gpu_match_transformers_bf16(tmp_path, family):
    require("transformers")
    folder, hf = write_family_checkpoint(tmp_path / "ckpt", family)
    want32 = hf_logits(hf.to("cuda", torch.float32), PROMPT)  # [T, vocab]
    hf16 = hf_logits(hf.to("cuda", torch.bfloat16), PROMPT)  # [T, vocab]
    ids = torch.tensor(PROMPT, device="cuda")
    batch = ForwardBatch.whole_sequences([len(PROMPT)], device="cuda")
    model = load_checkpoint(folder, device="cuda", dtype=torch.bfloat16)
    missing = missing_features(model.spec)
    if missing:
        with pytest.raises(ImplUnavailableError, match="|".join(sorted(missing))):
            model(ids, batch)
        model = load_checkpoint(folder, device="cuda", dtype=torch.bfloat16, attn_impl="reference")
    as_close_as_transformers_bf16(model(ids, batch), want32, hf16)
