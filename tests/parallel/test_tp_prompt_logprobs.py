"""prompt_logprobs through tensor-parallel ranks (gloo on the CPU): rank 0 scores the prompt rows
and sends them with its tokens, also for a prefill chunk that samples nothing; the scores equal
one process's."""

from __future__ import annotations

import pytest

from sparsegen import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]  # spawns ranks


def test_tp2_prompt_logprobs_equal_one_process():
    prompts = [list(range(1, 40)), [5, 6, 7]]  # 39 tokens in chunks of 16: two chunks sample nothing
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    one = LLM(random="tiny", device="cpu", max_num_batched_tokens=16)
    want = one.generate(prompts, params, use_tqdm=False)
    two = LLM(random="tiny", device="cpu", tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        got = two.generate(prompts, params, use_tqdm=False)
    finally:
        two.close()
    for g, w, ids in zip(got, want, prompts, strict=True):
        assert g.token_ids == w.token_ids
        assert len(g.prompt_logprobs) == len(ids) and g.prompt_logprobs[0] is None
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            assert a.token_id == b.token_id
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
