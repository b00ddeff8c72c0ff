"""The vectorised sampler against plain per-row Python references, and its randomness."""

from __future__ import annotations

import math

import pytest
import torch

from sparsegen.runner.sampling import (
    SamplingParams,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    greedy_argmax,
    sample,
    seeded_exponentials,
)


def _rows(seed: int, b: int, v: int) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def _kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def _ref_top_k_top_p(row: list[float], k: int, p: float) -> set[int]:
    """One row, by hand: keep tokens >= the k-th largest, then the smallest top-p prefix."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    kept = order if k <= 0 else [i for i in order if row[i] >= row[order[min(k, len(row)) - 1]]]
    z = sum(math.exp(row[i]) for i in kept)
    out, mass = [], 0.0
    for i in kept:
        if mass >= p:
            break
        out.append(i)
        mass += math.exp(row[i]) / z
    return set(out)


def _ref_argmax(row: list[float]) -> int:
    """One row, by hand: the first NaN if any, else the first index of the largest value."""
    for i, t in enumerate(row):
        if math.isnan(t):
            return i
    return max(range(len(row)), key=lambda i: (row[i], -i))


@pytest.mark.parametrize("v", [7, 1023, 1024, 1025, 3072, 5000])
@pytest.mark.parametrize("kind", ["random", "ties", "nan", "all_-inf", "max_in_pad_chunk", "-inf_and_ties"])
def test_greedy_argmax_matches_a_plain_reference(monkeypatch, v, kind):
    """The two-stage argmax: first maximal index, NaN as the maximum, -inf rows, ties across
    chunk borders, a vocabulary that pads its last chunk; and the plain torch.argmax it replaces."""
    monkeypatch.setattr("sparsegen.runner.sampling.ARGMAX_CHUNK", 1024)
    x = _rows(v, 4, v)
    if kind == "ties":
        x = x.round().clamp(max=2.0)  # many entries equal the maximum, in several chunks
    elif kind == "nan":
        x[1, v // 2] = x[1, v - 1] = float("nan")
        x[2, v - 1] = float("nan")
    elif kind == "all_-inf":
        x[:] = -math.inf
    elif kind == "max_in_pad_chunk":
        x[:, v - 1] = 100.0  # the maximum is the vocabulary's last entry, next to the padding
    elif kind == "-inf_and_ties":
        x[:] = -math.inf
        x[0, [3, v - 1]] = 1.0
        x[3, v - 1] = 0.0
    got = greedy_argmax(x)
    assert got.dtype == torch.int64 and got.shape == (4,)
    assert got.tolist() == [_ref_argmax(r) for r in x.tolist()] == x.argmax(dim=-1).tolist()
    monkeypatch.setattr("sparsegen.runner.sampling.ARGMAX_CHUNK", 0)
    assert greedy_argmax(x).tolist() == got.tolist()


@pytest.mark.parametrize("seed", range(6))
def test_top_k_top_p_per_row_settings_match_a_plain_reference(seed):
    b, v = 7, 40
    logits = _rows(seed, b, v)
    g = torch.Generator().manual_seed(100 + seed)
    ks = torch.randint(1, v + 5, (b,), generator=g)
    ps = torch.rand(b, generator=g).clamp_min(0.05)
    ps[0] = 1.0
    out = apply_top_k_top_p(logits, ks, ps)
    for r in range(b):
        assert _kept(out[r]) == _ref_top_k_top_p(logits[r].tolist(), int(ks[r]), float(ps[r]))
        finite = torch.isfinite(out[r])
        assert torch.equal(out[r][finite], logits[r][finite])  # kept values are untouched


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]]))
    out = apply_min_p(logits, torch.tensor([0.5, 0.9]))
    assert _kept(out[0]) == {0, 1}  # 0.15 < 0.5 * 0.5
    assert _kept(out[1]) == {0, 1, 2, 3}


def test_penalties_match_a_plain_reference():
    b, v = 4, 12
    logits = _rows(3, b, v)
    prompts = [[1, 2, 2], [], [5], [0, 11]]
    outputs = [[2, 3, 3, 3], [4], [], [11, 11, 7]]
    rep, pres, freq = [1.3, 0.7, 1.0, 2.0], [0.5, 0.0, -1.0, 2.0], [0.2, 1.5, 0.0, -0.4]
    got = apply_penalties(logits, prompts, outputs, torch.tensor(rep), torch.tensor(pres), torch.tensor(freq))
    for r in range(b):
        for t in range(v):
            x = float(logits[r, t])
            if t in prompts[r] or t in outputs[r]:
                x = x / rep[r] if x > 0 else x * rep[r]
            c = outputs[r].count(t)
            x -= freq[r] * c + pres[r] * (c > 0)
            assert float(got[r, t]) == pytest.approx(x, rel=1e-6, abs=1e-6), (r, t)


def test_greedy_rows_take_the_argmax_after_penalties_and_min_tokens():
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0]] * 3)
    plain = SamplingParams()
    no_eos = SamplingParams(min_tokens=2, stop_token_ids=(3,))
    rep = SamplingParams(repetition_penalty=10.0)
    out = sample(logits, [plain, no_eos, rep], [[], [0], [1]], [[], [], []], eos_token_id=1)
    # row 1: EOS (1) and stop token 3 are masked before min_tokens; row 2: token 1 seen, 5 -> 0.5
    assert out.token_ids == [1, 2, 3]
    assert out.logprobs == [None, None, None]
    done = sample(logits[:1], [no_eos], [[0, 0]], eos_token_id=1)  # min_tokens reached
    assert done.token_ids == [1]


def test_top_k_minus_one_and_zero_are_both_off():
    logits = _rows(5, 64, 30)
    hist = [[]] * 64
    a = sample(logits, [SamplingParams(temperature=1.0, top_k=-1, seed=s) for s in range(64)], hist)
    b = sample(logits, [SamplingParams(temperature=1.0, top_k=0, seed=s) for s in range(64)], hist)
    assert a.token_ids == b.token_ids


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = _rows(7, 5, 50)
    hot = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    others = [SamplingParams(), SamplingParams(temperature=1.0), SamplingParams(temperature=2.0, seed=9)]
    alone = sample(logits[2:3], [hot], [[1, 2]]).token_ids[0]
    mixed = sample(logits[[0, 1, 2, 3]], [others[0], others[1], hot, others[2]], [[], [5], [1, 2], []])
    assert mixed.token_ids[2] == alone
    # the noise is a function of (seed, step, column): another step gives other noise
    q = seeded_exponentials([1234, 1234, 1234], [2, 2, 3], 50, "cpu")
    assert torch.equal(q[0], q[1]) and not torch.equal(q[0], q[2])
    assert (q > 0).all() and torch.isfinite(q).all()


def test_sampled_frequencies_follow_the_distribution():
    """4000 independent seeded rows of one distribution; top_k=2 renormalises over the best two."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    n = 4000
    logits = probs.log().expand(n, 4).contiguous()
    hist = [[]] * n
    toks = torch.tensor(
        sample(logits, [SamplingParams(temperature=1.0, seed=s) for s in range(n)], hist).token_ids
    )
    freq = torch.bincount(toks, minlength=4).float() / n
    assert (freq - probs).abs().max() < 0.03, freq
    toks = sample(
        logits, [SamplingParams(temperature=1.0, top_k=2, seed=s) for s in range(n)], hist
    ).token_ids
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    assert freq[2] == 0 and freq[3] == 0
    assert abs(float(freq[0]) - 0.4 / 0.7) < 0.03
    # temperature sharpens: at T=0.25, p ~ probs**4
    sharp = probs**4 / (probs**4).sum()
    toks = sample(logits, [SamplingParams(temperature=0.25, seed=s) for s in range(n)], hist).token_ids
    freq = torch.bincount(torch.tensor(toks), minlength=4).float() / n
    assert (freq - sharp).abs().max() < 0.03, freq


def test_logprobs_are_the_raw_log_softmax():
    logits = _rows(11, 3, 25)
    params = [
        SamplingParams(logprobs=3),
        SamplingParams(temperature=1.0, repetition_penalty=3.0, seed=2, logprobs=0),
        SamplingParams(),
    ]
    out = sample(logits, params, [[], [4], []], [[1], [], []])
    ref = torch.log_softmax(logits.double(), dim=-1)
    for r in (0, 1):
        lp = out.logprobs[r]
        assert lp.token_id == out.token_ids[r]
        assert lp.logprob <= 0 and lp.logprob == pytest.approx(float(ref[r, lp.token_id]), abs=1e-5)
    top = out.logprobs[0].top
    assert [t for t, _ in top] == ref[0].topk(3).indices.tolist()
    assert [x for _, x in top] == pytest.approx(ref[0].topk(3).values.tolist(), abs=1e-5)
    assert out.logprobs[1].top == () and out.logprobs[2] is None
