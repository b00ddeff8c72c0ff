"""`SamplingParams(prompt_logprobs=k)` offline: `RequestOutput.prompt_logprobs` in vLLM's shape
(one entry per prompt token, the first None), checked against a whole-sequence forward pass of
the same weights (no cache, no engine), under chunked prefill, prefix caching, mixed batches and
preemption; bad values are InputErrors naming the field."""

from __future__ import annotations

import pytest
import torch

from sparsegen import LLM, SamplingParams
from sparsegen.engine.checks import check_params
from sparsegen.engine.prompt_scores import book_prompt_logprobs, first_prompt_logprobs
from sparsegen.errors import EngineError, InputError
from sparsegen.models.batch import ForwardBatch
from sparsegen.request.sampling_params import MAX_LOGPROBS, PromptLogprobs, TokenLogprobs
from sparsegen.request.sequence import Chunk, Plan, Sequence

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def llm():
    # chunks of 7 tokens: prompts span several chunks, none a multiple of the 16-token page
    return LLM(random="tiny", max_num_batched_tokens=7, max_num_seqs=4)


def oracle(llm, ids: list[int]) -> torch.Tensor:  # [T, V] float64 log-probabilities
    with torch.inference_mode():
        logits = llm.engine.model(torch.tensor(ids), ForwardBatch.whole_sequences([len(ids)]))
    return torch.log_softmax(logits.double(), dim=-1)


def check_against_oracle(llm, ids, scores, k):
    assert len(scores) == len(ids) and scores[0] is None
    lp = oracle(llm, ids)
    for i in range(1, len(ids)):
        s = scores[i]
        assert s.token_id == ids[i]
        assert s.logprob == pytest.approx(lp[i - 1, ids[i]].item(), abs=1e-4)
        assert len(s.top) == k
        if k:
            want = lp[i - 1].topk(k)
            assert [v for _, v in s.top] == pytest.approx(want.values.tolist(), abs=1e-4)
            assert s.top[0][1] >= s.logprob - 1e-6  # nothing beats the best


def test_prompt_logprobs_match_a_whole_forward_across_chunks(llm):
    ids = list(range(3, 40))  # 37 tokens: 6 chunks of 7
    out = llm.generate([ids], SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    check_against_oracle(llm, ids, out.prompt_logprobs, 3)
    assert out.outputs[0].logprobs is None  # prompt_logprobs does not turn on logprobs


def test_zero_gives_only_the_prompt_tokens_own(llm):
    ids = [5, 6, 7, 8]
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    check_against_oracle(llm, ids, out.prompt_logprobs, 0)


def test_the_most_allowed_is_twenty(llm):
    ids = list(range(40, 60))
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=MAX_LOGPROBS), use_tqdm=False)[0]
    check_against_oracle(llm, ids, out.prompt_logprobs, MAX_LOGPROBS)


def test_one_token_prompt_is_a_single_none(llm):
    out = llm.generate([[9]], SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


def test_not_asked_is_none_and_text_prompts_work(llm):
    out = llm.generate(["hello"], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is None
    scored = llm.generate(["hello"], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    check_against_oracle(llm, scored.prompt_token_ids, scored.prompt_logprobs, 1)


def test_scoring_beside_plain_requests_changes_no_token(llm):
    """A step that computes every row of one prompt samples the others from the same logits."""
    prompts = [list(range(10, 31)), list(range(50, 63)), [7, 8, 9]]
    plain = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed = llm.generate(
        prompts,
        [plain, SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=2), plain],
        use_tqdm=False,
    )
    assert [o.token_ids for o in mixed] == [o.token_ids for o in alone]
    assert mixed[0].prompt_logprobs is None and mixed[2].prompt_logprobs is None
    check_against_oracle(llm, prompts[1], mixed[1].prompt_logprobs, 2)


def test_prefix_cache_is_bypassed_for_scoring_and_still_filled(llm):
    """The scoring request computes its whole prompt (num_cached_tokens 0) even when its prefix
    is cached; the pages it computed serve a later plain request."""
    llm.engine.reset_prefix_cache()
    ids = list(range(100, 150))  # 50 tokens: 3 full pages
    first = llm.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check_against_oracle(llm, ids, again.prompt_logprobs, 1)
    llm.engine.reset_prefix_cache()
    llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)  # fills it
    plain = llm.generate([ids + [1, 2]], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert plain.num_cached_tokens == 48


def test_n_completions_each_carry_the_prompt_scores(llm):
    ids = list(range(20, 33))
    out = llm.generate([ids], SamplingParams(n=2, max_tokens=2, prompt_logprobs=1, seed=3), use_tqdm=False)[0]
    check_against_oracle(llm, ids, out.prompt_logprobs, 1)
    assert len(out.outputs) == 2


def test_preempted_scoring_requests_keep_whole_scores(monkeypatch):
    """A cache too small for every sequence preempts some after their first token; each still
    gets one score per prompt token, equal to the oracle's."""
    llm = LLM(random="tiny", num_pages=9, max_num_seqs=4, max_num_batched_tokens=16)
    sched = llm.engine.scheduler
    preempted = []
    real = sched._preempt
    monkeypatch.setattr(sched, "_preempt", lambda seq: preempted.append(seq.seq_id) or real(seq))
    prompts = [list(range(1 + i, 30 + i)) for i in range(4)]  # 29 tokens (2 pages) each
    params = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert preempted  # the case this test is for happened
    for ids, out in zip(prompts, outs, strict=True):
        assert len(out.token_ids) == 12
        check_against_oracle(llm, ids, out.prompt_logprobs, 1)


@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 1.0, True, "1", 10**30])
def test_out_of_range_is_an_input_error_naming_the_field(bad):
    with pytest.raises(InputError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_more_than_the_vocabulary_is_refused_by_the_engine():
    with pytest.raises(InputError, match="prompt_logprobs is 12, more than the vocabulary's 10"):
        check_params(SamplingParams(prompt_logprobs=12), vocab_size=10)
    assert check_params(SamplingParams(prompt_logprobs=10), vocab_size=10).prompt_logprobs == 10


def _scores(first: int, n: int) -> PromptLogprobs:
    return PromptLogprobs(0, first, tuple(TokenLogprobs(first + j, -float(first + j)) for j in range(n)))


def test_booking_keeps_what_a_recomputed_chunk_already_gave():
    seq = Sequence(0, list(range(10)), SamplingParams(prompt_logprobs=0))
    plan = Plan(False, (Chunk(seq, 0, 4),))
    book_prompt_logprobs(plan, [_scores(1, 3)])  # tokens 1..3
    book_prompt_logprobs(plan, [_scores(1, 5)])  # recomputed from 0 after a preemption: 1..5
    assert [s.token_id for s in seq.prompt_logprobs[1:]] == [1, 2, 3, 4, 5]
    with pytest.raises(EngineError, match="from token 8, but only 6 are booked"):
        book_prompt_logprobs(plan, [_scores(8, 1)])  # a gap can never be booked
    seq.output_ids.append(3)
    with pytest.raises(EngineError, match="6 prompt log-probabilities for 10 tokens"):
        first_prompt_logprobs(seq)  # the first token needs the whole prompt scored
