"""The sampler at extreme valid values: tiny temperatures, top_p and repetition penalties, huge
penalties and temperatures, a min_tokens that bans every token. None of them may give NaN
probabilities, which the exponential race turns into "token 0 forever". Each check is
statistical and can fail: drawn tokens are compared with the argmax they must be, or their
counts with the distribution they must follow (computed here in float64, independently).
"""

from __future__ import annotations

import pytest
import torch

from sparsegen.request.sampling_params import FLOAT32_MAX, GREEDY_TEMPERATURE, SamplingParams
from sparsegen.runner.sampling import sample

V = 32
N = 4000  # draws of one row, each with its own seed


def _logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=gen) * scale  # [rows, V]


def _draw(logits: torch.Tensor, params: list[SamplingParams], prompts=None, eos=None) -> list[int]:
    b = logits.shape[0]
    out = sample(logits, params, [[] for _ in range(b)], prompts, eos_token_id=eos)
    return out.token_ids


def _seeded(n: int, **kw) -> list[SamplingParams]:
    return [SamplingParams(seed=i, **kw) for i in range(n)]


def _counts(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=V).double()


def assert_follows(tokens: list[int], probs: torch.Tensor) -> None:
    """The tokens' counts agree with `probs` [V]: impossible tokens never appear, and every
    count is within 5 standard deviations (plus 3) of its expectation."""
    n = len(tokens)
    counts = _counts(tokens)
    assert not bool((counts[probs == 0] > 0).any()), f"drew impossible tokens: {counts[probs == 0]}"
    expect = probs * n
    sd = (n * probs * (1 - probs)).sqrt()
    worst = ((counts - expect).abs() - 5 * sd - 3).max().item()
    assert worst <= 0, f"counts {counts.tolist()} against expected {expect.tolist()}"


def _softmax64(x: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(x.double() / temperature, dim=-1)


# -- below vLLM's threshold a row is greedy ---------------------------------------------------
@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45, 1e-30, 1e-6, 9.99e-6])
def test_tiny_temperature_is_the_argmax(temperature):
    assert SamplingParams(temperature=temperature).greedy
    x = _logits(512)
    tokens = _draw(x, _seeded(512, temperature=temperature, top_p=0.5, top_k=5))
    assert tokens == x.argmax(dim=-1).tolist()


def test_the_threshold_itself_samples_and_lands_on_clear_winners():
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    x = _logits(512)
    top2 = x.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # the runner-up is exp(-100) as likely
    tokens = torch.tensor(_draw(x, _seeded(512, temperature=GREEDY_TEMPERATURE)))
    assert bool(clear.float().mean() > 0.9)
    assert bool((tokens[clear] == x.argmax(dim=-1)[clear]).all())


def test_a_tiny_temperature_on_a_near_tie_is_not_token_0():
    x = torch.full((N, V), -1.0)
    x[:, 7] = 2.0
    x[:, 19] = 2.0 - 1e-7  # one float32 step below: a tie at any temperature of 1e-5
    tokens = _draw(x, _seeded(N, temperature=GREEDY_TEMPERATURE))
    counts = _counts(tokens)
    assert counts[7] + counts[19] == N and counts[0] == 0
    assert counts[7] > N / 4 and counts[19] > N / 4, counts.tolist()


# -- top_p below float32's range keeps the most likely token ------------------------------------
@pytest.mark.parametrize("top_p", [5e-324, 1e-60, 1e-40, 1e-8])
def test_tiny_top_p_keeps_only_the_most_likely(top_p):
    x = _logits(512, scale=1.0)
    tokens = _draw(x, _seeded(512, temperature=1.0, top_p=top_p))
    assert tokens == x.argmax(dim=-1).tolist()


def test_top_p_still_follows_its_nucleus():
    x = _logits(1, seed=3, scale=1.5)[0]
    temperature, top_p = 0.7, 0.8
    p = _softmax64(x, temperature)
    order = p.argsort(descending=True)
    before = p[order].cumsum(0) - p[order]
    keep = torch.zeros(V, dtype=torch.bool)
    keep[order[before < top_p]] = True
    nucleus = torch.where(keep, p, 0.0)
    tokens = _draw(x.expand(N, V), _seeded(N, temperature=temperature, top_p=top_p))
    assert_follows(tokens, nucleus / nucleus.sum())


# -- repetition penalties at both ends --------------------------------------------------------
def test_tiny_repetition_penalty_picks_the_best_seen_positive_token():
    """Divided by 1e-300, a seen token's positive logit outweighs everything: the draw is the
    largest positive logit among the seen tokens (the argmax itself is kept unseen)."""
    rows = 256
    x = _logits(rows, seed=1, scale=1.0).clamp(-3.5, 3.5)  # [rows, V]: no two overflow to a tie
    gen = torch.Generator().manual_seed(2)
    prompts, expect = [], []
    for r in range(rows):
        best = int(x[r].argmax())
        seen = [t for t in torch.randperm(V, generator=gen)[:8].tolist() if t != best]
        positive = [t for t in seen if x[r, t] > 0]
        if not positive:  # make one seen token positive (and not the argmax)
            x[r, seen[0]] = x[r, best] / 2 if x[r, best] > 0 else 0.5
            positive = [seen[0]]
        prompts.append(seen)
        expect.append(max(positive, key=lambda t: float(x[r, t])))
    for temperature in (0.0, 1.0, 50.0):
        params = _seeded(rows, temperature=temperature, repetition_penalty=1e-300)
        out = sample(x, params, [[] for _ in range(rows)], prompts)
        assert out.token_ids == expect, temperature


def test_tiny_repetition_penalty_on_logits_that_overflow_ties_the_overflowed():
    x = torch.full((N, V), -1.0)
    x[:, [3, 11]] = 30.0  # 30 / float32's smallest normal overflows: both become the largest float
    x[:, 0] = 40.0  # unseen: far behind them after the penalty
    out = sample(x, _seeded(N, temperature=1.0, repetition_penalty=1e-300), [[]] * N, [[3, 11]] * N)
    counts = _counts(out.token_ids)
    assert counts[3] + counts[11] == N
    assert counts[3] > N / 4 and counts[11] > N / 4, counts.tolist()


def test_huge_repetition_penalty_follows_the_penalised_distribution():
    x = _logits(1, seed=4, scale=1.0)[0]
    seen = [int(t) for t in x.topk(4).indices] + [int(t) for t in (-x).topk(4).indices]
    pen = x.double().clone()
    pen[seen] = torch.where(pen[seen] > 0, pen[seen] / 1e6, pen[seen] * 1e6)
    p = torch.softmax(pen, dim=-1)
    params = _seeded(N, temperature=1.0, repetition_penalty=1e6)
    out = sample(x.expand(N, V), params, [[]] * N, [seen] * N)
    assert_follows(out.token_ids, p)


def test_extreme_presence_and_frequency_penalties_follow_the_distribution():
    x = _logits(1, seed=5, scale=1.0)[0]
    history = [1, 1, 1, 2, 5, 5] * 50  # 150 counts of token 1: -2 * 150 pushes it out
    counts = torch.bincount(torch.tensor(history), minlength=V).double()
    pen = x.double() - 2.0 * counts - 2.0 * (counts > 0).double()
    out = sample(
        x.expand(N, V),
        _seeded(N, temperature=1.0, presence_penalty=2.0, frequency_penalty=2.0),
        [history] * N,
        [[]] * N,
    )
    assert_follows(out.token_ids, torch.softmax(pen, dim=-1))


# -- huge temperatures and masks ----------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e30, FLOAT32_MAX])
def test_huge_temperature_is_uniform_over_what_is_allowed(temperature):
    x = _logits(1, seed=6, scale=20.0)[0]
    params = _seeded(N, temperature=temperature, min_tokens=1, stop_token_ids=(4,))
    tokens = _draw(x.expand(N, V), params, eos=9)  # min_tokens bans EOS (9) and the stop id (4)
    allowed = torch.ones(V, dtype=torch.float64)
    allowed[[4, 9]] = 0
    assert_follows(tokens, allowed / allowed.sum())


def test_min_tokens_that_would_ban_every_token_bans_none():
    x = _logits(1, seed=7, scale=1.0)[0]
    everything = tuple(range(V))
    greedy = _draw(x.expand(4, V), _seeded(4, min_tokens=3, stop_token_ids=everything))
    assert greedy == [int(x.argmax())] * 4
    tokens = _draw(x.expand(N, V), _seeded(N, temperature=1.0, min_tokens=3, stop_token_ids=everything))
    assert_follows(tokens, _softmax64(x, 1.0))


def test_min_p_tiny_and_top_k_huge_change_nothing():
    x = _logits(1, seed=8, scale=1.0)[0]
    params = _seeded(N, temperature=1.0, min_p=1e-60, top_k=2**31 - 1)
    assert_follows(_draw(x.expand(N, V), params), _softmax64(x, 1.0))


def test_no_row_is_nan_in_a_batch_of_extremes():
    """Every extreme at once, in one batch, one row each: every row's token is one its row can
    produce (the argmax where the value makes the row greedy)."""
    x = _logits(6, seed=9)
    params = [
        SamplingParams(temperature=1e-300, seed=1),
        SamplingParams(temperature=1.0, top_p=1e-60, seed=2),
        SamplingParams(temperature=1e-45, repetition_penalty=1e-300, seed=3),
        SamplingParams(temperature=FLOAT32_MAX, repetition_penalty=1e6, seed=4),
        SamplingParams(temperature=1.0, top_p=5e-324, top_k=1, min_p=1.0, seed=5),
        SamplingParams(temperature=1e-5, presence_penalty=-2.0, frequency_penalty=-2.0, seed=6),
    ]
    x[2, 0], x[2, 1] = -1.0, 0.5  # row 2's seen tokens (0 and 1): the positive one wins
    out = sample(x, params, [[0, 0]] * 6, [[1]] * 6)
    argmax = x.argmax(dim=-1).tolist()
    assert [out.token_ids[r] for r in (0, 1, 2, 4)] == [argmax[0], argmax[1], 1, argmax[4]]
    assert all(0 <= t < V for t in out.token_ids)
