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


def _counting(monkeypatch, module, name: str, calls: list) -> None:
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(name) or real(*a, **kw))


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_family_fast_paths_with_cuda_graphs_track_transformers_bf16(tmp_path, family, monkeypatch):
    """The engine on the GPU in bf16 with the families' fast paths (fused QKV / gate_up, the
    batch-1 GEMV with add + RMSNorm, SwiGLU / GeGLU and the rotary + K/V write inside, the fused
    add + norm and rotary kernels) and decode steps replayed from CUDA graphs: the prefill logits
    are within bf16 tolerance of transformers' bf16 ones, and every greedy token is one that
    transformers' bf16 logits (teacher-forced over the same tokens) rank at the top within that
    tolerance. The fast kernels were launched (counted while the graphs were captured)."""
    require("transformers")
    import sparsegen.kernels.fused.add_norm as an
    import sparsegen.kernels.linear.gemv as gm
    from sparsegen.engine import LLMEngine, SamplingParams

    folder, hf = write_family_checkpoint(tmp_path / "ckpt", family)
    model = load_checkpoint(folder, device="cuda", dtype=torch.bfloat16)
    assert model.fused and model.gemv  # the defaults on a GPU
    missing = missing_features(model.spec)
    if missing:  # refused by name before anything runs (the test above checks the reference path)
        with pytest.raises(ImplUnavailableError, match="|".join(sorted(missing))):
            model(
                torch.tensor(PROMPT, device="cuda"),
                ForwardBatch.whole_sequences([len(PROMPT)], device="cuda"),
            )
        return
    calls: list[str] = []
    _counting(monkeypatch, gm, "gemv", calls)
    _counting(monkeypatch, an, "add_layer_norm", calls)
    engine = LLMEngine(model, kv_cache_bytes=64 << 20, max_num_seqs=4)
    new = 12
    out = engine.generate([PROMPT], SamplingParams(max_tokens=new, ignore_eos=True))[0].token_ids
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs, "no CUDA graph was captured"
    assert "gemv" in calls and "add_layer_norm" in calls, calls
    # transformers' logits over the same tokens, teacher-forced: [T, vocab] float32 and bf16
    want32 = hf_logits(hf.to("cuda", torch.float32), PROMPT + out[:-1])
    hf16 = hf_logits(hf.to("cuda", torch.bfloat16), PROMPT + out[:-1])
    batch = ForwardBatch.whole_sequences([len(PROMPT)], device="cuda")
    got = model(torch.tensor(PROMPT, device="cuda"), batch)
    as_close_as_transformers_bf16(got, want32[: len(PROMPT)], hf16[: len(PROMPT)])
    tol = 1.5 * max_err(hf16, want32) + 1e-2 * want32.abs().max().item()
    for i, token in enumerate(out):  # each greedy token is at the top of the float32 truth, within tol
        row = want32[len(PROMPT) - 1 + i]
        assert row[token] >= row.max() - tol, (i, token, row.argmax().item())
