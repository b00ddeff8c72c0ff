"""Limits of SamplingParams: every value one batched step cannot hold is refused when the request
is made (an InputError naming the field), and every value at a limit runs through the sampler.

The failure this guards against: `top_k = 2**70` passed validation, then failed inside the
batched step ("Overflow when unpacking long long"), taking every other row of the batch with it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from sparsegen.engine.checks import check_params
from sparsegen.errors import InputError
from sparsegen.request.sampling_params import (
    FLOAT32_MAX,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_TOKEN_COUNT,
    SEED_LIMIT,
    SamplingParams,
)
from sparsegen.runner.sampling import sample

HUGE = [2**31, 2**63, 2**64, 2**70, 10**400]

TOO_BIG = {
    "n": [MAX_N + 1, *HUGE],
    "max_tokens": [MAX_TOKEN_COUNT + 1, *HUGE],
    "top_k": [MAX_TOKEN_COUNT + 1, *HUGE, -(2**70)],
    "logprobs": [MAX_LOGPROBS + 1, *HUGE],
    "seed": [SEED_LIMIT, 2**70, 10**400, -(2**70)],
    # a float field given an int no float holds: math.isfinite() itself raises OverflowError
    "temperature": [1e39, 2**1024, 10**400, FLOAT32_MAX * 2],
    "top_p": [10**400],
    "min_p": [10**400],
    "repetition_penalty": [MAX_REPETITION_PENALTY * 2, 10**400, 1e308],
    "presence_penalty": [10**400, -(10**400)],
    "frequency_penalty": [10**400, -(10**400)],
}
CASES = [(f, v) for f, vs in TOO_BIG.items() for v in vs]


@pytest.mark.parametrize("field,value", CASES, ids=[f"{f}={v!r:.20}" for f, v in CASES])
def test_out_of_range_value_is_refused_naming_the_field(field, value):
    with pytest.raises(InputError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value", [MAX_TOKEN_COUNT + 1, 2**70, 10**400])
def test_min_tokens_beyond_int32_is_refused(value):
    with pytest.raises(InputError, match=r"SamplingParams\.min_tokens\b"):
        SamplingParams(min_tokens=value, max_tokens=MAX_TOKEN_COUNT)


@pytest.mark.parametrize("ids", [[MAX_TOKEN_COUNT + 1], [0, 2**70], [10**400]])
def test_stop_token_ids_beyond_int32_are_refused(ids):
    with pytest.raises(InputError, match=r"SamplingParams\.stop_token_ids\b"):
        SamplingParams(stop_token_ids=ids)


# -- every limit itself runs through one batched step ---------------------------------------
AT_LIMITS = [
    SamplingParams(temperature=1.0, top_k=MAX_TOKEN_COUNT),
    SamplingParams(temperature=1.0, top_k=-1),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(
        max_tokens=MAX_TOKEN_COUNT, min_tokens=MAX_TOKEN_COUNT, stop_token_ids=(3, MAX_TOKEN_COUNT)
    ),
    SamplingParams(temperature=1.0, seed=SEED_LIMIT - 1),
    SamplingParams(temperature=1.0, seed=0),
    SamplingParams(temperature=FLOAT32_MAX, min_tokens=5, max_tokens=5, stop_token_ids=(1,)),
    SamplingParams(temperature=1.0, repetition_penalty=MAX_REPETITION_PENALTY),
    SamplingParams(temperature=1.0, presence_penalty=-2.0, frequency_penalty=2.0),
    SamplingParams(temperature=1.0, min_p=1.0, top_p=1.0),
    SamplingParams(logprobs=MAX_LOGPROBS),
    SamplingParams(n=MAX_N),
]


def test_a_batch_of_limits_samples_every_row():
    vocab = 64
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(AT_LIMITS), vocab, generator=gen) * 5  # [B, V]
    history = [[1, 2, 2]] * len(AT_LIMITS)
    out = sample(logits, AT_LIMITS, history, [[5, 6]] * len(AT_LIMITS), eos_token_id=0)
    assert len(out.token_ids) == len(AT_LIMITS)
    assert all(0 <= t < vocab for t in out.token_ids)
    lp = out.logprobs[AT_LIMITS.index(SamplingParams(logprobs=MAX_LOGPROBS))]
    assert len(lp.top) == MAX_LOGPROBS and all(math.isfinite(x) for _, x in lp.top)
    row = AT_LIMITS.index(SamplingParams(temperature=1.0, top_k=1))
    assert out.token_ids[row] == int(logits[row].argmax())
    masked = 3  # min_tokens not reached: EOS (0) and the stop ids (1, 3) are never drawn
    assert out.token_ids[masked] not in (0, 3)
    assert out.token_ids[6] not in (0, 1)


# -- the engine's boundary re-checks what reaches it ------------------------------------------
def _tampered(**fields) -> SamplingParams:
    p = SamplingParams(temperature=1.0)
    for name, value in fields.items():
        object.__setattr__(p, name, value)
    return p


TAMPERED = [
    ("top_k", 2**70),
    ("max_tokens", 2**63),
    ("min_tokens", -1),
    ("temperature", math.nan),
    ("temperature", 1e39),
    ("top_p", 0.0),
    ("repetition_penalty", 0.0),
    ("seed", -1),
    ("logprobs", 10**6),
    ("n", 0),
    ("stop", ["x"]),
    ("stop_token_ids", (2**40,)),
]


@pytest.mark.parametrize("field,value", TAMPERED, ids=[f"{f}={v!r:.20}" for f, v in TAMPERED])
def test_check_params_refuses_a_tampered_object(field, value):
    with pytest.raises(InputError, match=field):
        check_params(_tampered(**{field: value}), vocab_size=100)


def test_check_params_bounds_by_the_vocabulary():
    with pytest.raises(InputError, match="logprobs"):
        check_params(SamplingParams(logprobs=MAX_LOGPROBS), vocab_size=8)
    with pytest.raises(InputError, match="stop_token_ids"):
        check_params(SamplingParams(stop_token_ids=(8,)), vocab_size=8)
    assert check_params(SamplingParams(logprobs=8, stop_token_ids=(7,)), vocab_size=8).logprobs == 8


def test_check_params_runs_the_class_checks_whatever_a_subclass_does():
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Lax(SamplingParams):
        def validate(self) -> None:  # a subclass that checks nothing
            pass

    with pytest.raises(InputError, match="top_k"):
        check_params(Lax(top_k=2**70), vocab_size=100)


def test_engine_refuses_before_queueing_and_goes_on(model):
    from sparsegen.engine import LLMEngine

    engine = LLMEngine(model, num_pages=64, use_cuda_graphs=False)
    with pytest.raises(InputError, match="top_k"):
        engine.submit([[1, 2], [3, 4]], [SamplingParams(max_tokens=2), _tampered(top_k=2**70)])
    assert not engine.has_unfinished
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity
    (res,) = engine.generate([[1, 2]], SamplingParams(max_tokens=3, temperature=1.0, top_k=MAX_TOKEN_COUNT))
    assert len(res.token_ids) == 3 and all(0 <= t < model.config.vocab_size for t in res.token_ids)
