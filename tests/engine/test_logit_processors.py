"""`logit_bias` and `allowed_token_ids`: their checks, the batched sampler step against a per-row
reference, and the engine's vocabulary check."""

from __future__ import annotations

import math

import pytest
import torch

from sparsegen.engine.checks import check_params
from sparsegen.errors import InputError
from sparsegen.request.sampling_params import MAX_ALLOWED_TOKEN_IDS, MAX_LOGIT_BIAS_ENTRIES
from sparsegen.runner.sampling import SamplingParams, apply_logit_processors, sample


def _rows(seed: int, b: int, v: int) -> torch.Tensor:
    return torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3


def _reference(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row by hand: add each bias, then -inf outside the allowed set."""
    out = row.clone()
    for tok, bias in p.logit_bias:
        out[tok] = out[tok] + bias
    if p.allowed_token_ids is not None:
        allowed = set(p.allowed_token_ids)
        for tok in range(out.shape[0]):
            if tok not in allowed:
                out[tok] = -math.inf
    return out


def test_params_normalise_a_dict_to_sorted_pairs():
    p = SamplingParams(logit_bias={7: -1.5, 2: 100, 5: -100.0})
    assert p.logit_bias == ((2, 100), (5, -100.0), (7, -1.5))
    assert p.has_logit_processors and not SamplingParams().has_logit_processors
    assert SamplingParams(allowed_token_ids=[3, 1]).allowed_token_ids == (3, 1)
    hash(p)  # frozen and hashable: pairs, not a dict


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: -101}}, "logit_bias"),
        ({"logit_bias": {1: math.nan}}, "logit_bias"),
        ({"logit_bias": {1: math.inf}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": {"1": 1.0}}, "logit_bias"),
        ({"logit_bias": {1: "1"}}, "logit_bias"),
        ({"logit_bias": {2**31: 1.0}}, "logit_bias"),
        ({"logit_bias": [(1, 1.0), (1, 2.0)]}, "logit_bias"),
        ({"logit_bias": [(1, 1.0, 3)]}, "logit_bias"),
        ({"logit_bias": 5}, "logit_bias"),
        ({"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids"),
        ({"allowed_token_ids": 3}, "allowed_token_ids"),
        ({"allowed_token_ids": list(range(MAX_ALLOWED_TOKEN_IDS + 1))}, "allowed_token_ids"),
    ],
)
def test_bad_processor_params_name_the_field(kwargs, field):
    with pytest.raises(InputError, match=field):
        SamplingParams(**kwargs)


def test_engine_check_refuses_ids_outside_the_vocabulary():
    assert check_params(SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[0, 9]), 10)
    with pytest.raises(InputError, match="logit_bias holds token 10"):
        check_params(SamplingParams(logit_bias={0: 1.0, 10: 1.0}), 10)
    with pytest.raises(InputError, match="allowed_token_ids holds 12"):
        check_params(SamplingParams(allowed_token_ids=[12, 0]), 10)


def test_batched_step_matches_the_per_row_reference():
    v = 37
    params = [
        SamplingParams(),
        SamplingParams(logit_bias={0: 100.0, 5: -100.0, 36: 2.5}),
        SamplingParams(allowed_token_ids=[3, 30, 7]),
        SamplingParams(logit_bias={3: -4.0, 8: 9.0}, allowed_token_ids=[3, 4]),
        SamplingParams(allowed_token_ids=list(range(v))),
    ]
    x = _rows(0, len(params), v)
    out = apply_logit_processors(x, params)
    assert out.shape == x.shape and not torch.isnan(out).any()
    for r, p in enumerate(params):
        assert torch.equal(out[r], _reference(x[r], p)), r
    assert torch.equal(out[0], x[0])  # a row with neither is untouched


def test_bias_never_makes_inf_and_allowed_rows_sample_inside_the_set():
    v = 50
    big = torch.full((2, v), 3.0e38)
    out = apply_logit_processors(big, [SamplingParams(logit_bias={1: 100.0})] * 2)
    assert torch.isfinite(out).all()
    allowed = (4, 11, 49)
    for seed in range(20):
        params = [
            SamplingParams(temperature=1.0, seed=seed, allowed_token_ids=allowed),
            SamplingParams(allowed_token_ids=allowed),  # greedy
            SamplingParams(temperature=2.0, top_k=3, seed=seed, logit_bias={0: 100.0}),
        ]
        res = sample(_rows(seed, 3, v), params, [[], [], []])
        assert res.token_ids[0] in allowed and res.token_ids[1] in allowed
        assert res.token_ids[2] == 0  # +100 on a randn*3 row leaves token 0 with all the mass


def test_logprobs_stay_the_raw_models():
    """Logprobs are the model's raw distribution (as documented), before bias or masking."""
    x = _rows(3, 1, 20)
    res = sample(x, [SamplingParams(logprobs=2, allowed_token_ids=[5], logit_bias={5: -50.0})], [[]])
    raw = torch.log_softmax(x[0], dim=-1)
    assert res.token_ids == [5]
    assert res.logprobs[0].logprob == pytest.approx(raw[5].item(), abs=1e-6)


def test_min_tokens_that_would_ban_every_allowed_token_leaves_the_row_unmasked():
    """allowed_token_ids == the stop tokens, min_tokens unmet: no token would be left, so (as when
    min_tokens would ban the whole vocabulary) the row samples from its allowed set unmasked."""
    x = _rows(5, 2, 30)
    params = [
        SamplingParams(
            temperature=1.0, seed=1, min_tokens=3, stop_token_ids=[4, 9], allowed_token_ids=[4, 9]
        ),
        SamplingParams(min_tokens=3, stop_token_ids=[4], allowed_token_ids=[4, 9]),  # 9 survives
    ]
    res = sample(x, params, [[], []], eos_token_id=9)
    assert res.token_ids[0] in (4, 9)
    params[1] = SamplingParams(min_tokens=3, stop_token_ids=[4], allowed_token_ids=[4, 8])
    res = sample(x, params, [[], []], eos_token_id=9)
    assert res.token_ids[1] == 8  # 4 is banned until min_tokens; 8 is the only token left
