"""The model's prefill through the generated Triton kernel, in Triton's interpreter on a CPU.

This checks the model-to-kernel contract (contiguity, dtypes, varlen batches, chunks with a
cached prefix) without a GPU. fp32: the interpreter computes bf16 dots wrongly. Run by
tests/test_model_triton_interpreter.py in a fresh process with TRITON_INTERPRET=1 set before
Triton is imported (or directly: TRITON_INTERPRET=1 pytest tests/interpreter_model_cases.py).
"""

from __future__ import annotations

import pytest
import torch
from helpers_checkpoint import single_thread  # noqa: F401

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import ForwardBatch, random_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(autouse=True)
def _interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SPARSEGEN_QUIET", "1")


def test_engine_with_generated_prefill_kernel_matches_reference():
    pytest.importorskip("triton")
    triton_model = random_model("tiny", seed=4, attn_impl="triton")
    ref_model = random_model("tiny", seed=4, attn_impl="reference")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (90, 45)]
    ids = torch.tensor(sum(prompts, []))
    batch = ForwardBatch.whole_sequences([90, 45])
    got, want = triton_model(ids, batch), ref_model(ids, batch)
    torch.testing.assert_close(got[:, :261], want[:, :261], atol=1e-4, rtol=1e-4)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    fast = LLMEngine(triton_model, max_num_batched_tokens=40)  # chunks over a cached prefix
    slow = LLMEngine(ref_model)
    assert [r.output_ids for r in fast.generate(prompts, params)] == [
        r.output_ids for r in slow.generate(prompts, params)
    ]
