"""GPU tier of prompt_logprobs: the compiled kernels in bf16 (prefill chunks over a paged prefix,
the last layer over every row of a scored chunk), the scores copied back through pinned memory,
against a whole-sequence forward of the same bf16 weights with the reference attention (the
weights are identical on both sides, same seed on the same device; only attention differs).

Run on a GPU with `pytest -m gpu tests/llm/test_prompt_logprobs_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import ForwardBatch, random_model

pytestmark = pytest.mark.gpu

TINY_KV = 256 << 20


def test_prompt_logprobs_on_the_gpu_match_the_reference():
    model = random_model("tiny", seed=0, device="cuda", dtype=torch.bfloat16)
    engine = LLMEngine(model, kv_cache_bytes=TINY_KV, max_num_batched_tokens=48)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (150, 37, 5)]
    params = [SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=k) for k in (2, 0, 5)]
    outs = engine.generate(prompts, params)
    ref = random_model("tiny", seed=0, device="cuda", dtype=torch.bfloat16, attn_impl="reference")
    for ids, out, p in zip(prompts, outs, params, strict=True):
        scores = out.prompt_logprobs
        assert len(scores) == len(ids) and scores[0] is None
        with torch.inference_mode():
            logits = ref(torch.tensor(ids, device="cuda"), ForwardBatch.whole_sequences([len(ids)], "cuda"))
        lp = torch.log_softmax(logits.double(), dim=-1).cpu()  # [T, V]
        got = torch.tensor([s.logprob for s in scores[1:]], dtype=torch.float64)
        want = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.isfinite(got).all()
        assert (got - want).abs().max() < 0.1  # bf16 kernels against the reference's attention
        assert all(len(s.top) == p.prompt_logprobs for s in scores[1:])
        assert [s.token_id for s in scores[1:]] == ids[1:]
