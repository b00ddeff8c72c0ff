"""SamplingParams takes exact types: every bad value is an InputError that names its field."""

from __future__ import annotations

import math

import pytest

from sparsegen.errors import InputError
from sparsegen.runner.sampling import MAX_LOGPROBS, SamplingParams

NOT_NUMBERS = [True, False, "1", None, [1], {"a": 1}, b"1", 1j]
NON_FINITE = [math.nan, math.inf, -math.inf]
INT_FIELDS_BAD_TYPES = [True, 1.0, 2.5, "3", None, [1], math.nan]

BAD = {
    "n": [0, -1, *INT_FIELDS_BAD_TYPES],
    "max_tokens": [0, -5, *INT_FIELDS_BAD_TYPES],
    "min_tokens": [-1, 1.0, True, "0"],
    "temperature": [-0.1, -1, *NOT_NUMBERS, *NON_FINITE],
    "top_p": [0, 0.0, -0.5, 1.0001, 2, *NOT_NUMBERS, *NON_FINITE],
    "top_k": [-2, -100, 1.5, 1.0, True, "5", None],
    "min_p": [-0.01, 1.5, *NOT_NUMBERS, *NON_FINITE],
    "repetition_penalty": [0, 0.0, -1.0, *NOT_NUMBERS, *NON_FINITE],
    "presence_penalty": [-2.01, 2.5, *NOT_NUMBERS, *NON_FINITE],
    "frequency_penalty": [-3, 2.0001, *NOT_NUMBERS, *NON_FINITE],
    "stop": [1, ["ok", 2], [""], "", [None], b"x", {"a": 1}, ["a", True]],
    "stop_token_ids": ["abc", 5, [1, True], [1.0], [-1], [None], {"a": 1}],
    "ignore_eos": [1, 0, "true", None, 1.0],
    "logprobs": [-1, MAX_LOGPROBS + 1, 1.0, True, "2"],
    "seed": [-1, 2**64, 2**70, 1.0, True, "7"],
}
CASES = [(field, value) for field, values in BAD.items() for value in values]


@pytest.mark.parametrize("field,value", CASES, ids=[f"{f}={v!r}" for f, v in CASES])
def test_bad_value_names_the_field(field, value):
    with pytest.raises(InputError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(InputError, match="min_tokens"):
        SamplingParams(max_tokens=3, min_tokens=4)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        SamplingParams(1, 16)  # kw-only: vLLM's field order is not ours to promise


def test_good_values_are_normalised():
    p = SamplingParams(
        n=3, max_tokens=5, min_tokens=5, temperature=1, top_p=0.5, top_k=-1, min_p=1, repetition_penalty=1.5,
        presence_penalty=-2, frequency_penalty=2, stop="END", stop_token_ids=[3, 4], ignore_eos=True,
        logprobs=0, seed=2**64 - 1,
    )  # fmt: skip
    assert p.stop == ("END",) and p.stop_token_ids == (3, 4)
    assert not p.top_k_enabled and p.has_penalties and not p.greedy
    assert SamplingParams(stop=None, stop_token_ids=None).stop == ()
    with pytest.raises(AttributeError):
        p.n = 2  # frozen
