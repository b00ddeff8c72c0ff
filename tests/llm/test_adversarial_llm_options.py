"""`LLM(...)`'s options against wrong types and out-of-range values: each is a typed error naming
the option, raised before a model is built; a collective timeout is bounded by what torch's
process groups can hold, and a tokenizer must be a path."""

from __future__ import annotations

import math

import pytest
from helpers.adversarial import refused

from sparsegen import LLM
from sparsegen.errors import InputError, SparsegenError, TokenizerError
from sparsegen.runner.config import MAX_COLLECTIVE_TIMEOUT_S, MIN_COLLECTIVE_TIMEOUT_S, EngineConfig

NOT_INTS = [True, 0.5, math.nan, math.inf, "16", "\ud800", [], {}, b"1"]
NOT_BOOLS = [0, 1, "true", None, 1.0, []]
INT_OPTIONS = {  # option: values below its least
    "page_size": [0, -1, 129, 2**70],
    "num_pages": [1, 0, -(2**70)],
    "kv_cache_bytes": [0, -1],
    "max_num_seqs": [0, 4097, 2**64],
    "max_num_batched_tokens": [0, -5],
    "max_model_len": [1, 0, -1],
}
BOOL_OPTIONS = ("use_cuda_graphs", "compile_model", "async_decode", "enable_prefix_caching", "force_dense")
CASES = [
    *[(opt, v) for opt, low in INT_OPTIONS.items() for v in [*low, *NOT_INTS]],
    *[(opt, v) for opt in BOOL_OPTIONS for v in NOT_BOOLS],
    *[("kv_cache_dtype", v) for v in ("fp16", "FP8", "", None, 8, "fp8 ", "\ud800")],
    *[("kv_layout", v) for v in ("", "tokens", "HEAD", None, 1)],
    *[("seed", v) for v in (-1, 2**64, 1.0, "1", True, None)],
    *[("tensor_parallel_size", v) for v in (0, -1, 1.0, "2", True)],
    *[("collective_timeout_s", v) for v in (0, -1, 1e-45, 1e-300, 1e-4, 1e308, 2**70, math.inf, math.nan, True,
                                             "1", [], MAX_COLLECTIVE_TIMEOUT_S * 1.0001)],
    *[("random", v) for v in ("huge", "", None, 5, "\ud800")],
]  # fmt: skip


@pytest.mark.parametrize("option,value", CASES, ids=[f"{o}={v!r:.20}" for o, v in CASES])
def test_bad_option_is_a_typed_error(option, value):
    kwargs = {"random": "tiny", option: value}
    if option == "random" and value is None:
        kwargs = {"random": None}  # neither model nor random
    err = refused(SparsegenError, r"\S", LLM, **kwargs)
    assert isinstance(err, InputError | TokenizerError)
    if option != "random" or value is not None:
        assert option in str(err) or option.replace("_", " ") in str(err), str(err)


@pytest.mark.parametrize("value", [0, 1.5, [], {}, b"/tmp", True, object()])
def test_a_tokenizer_that_is_not_a_path_is_refused(value):
    err = refused(TokenizerError, "tokenizer path must be a str or Path", LLM, random="tiny", tokenizer=value)
    assert type(value).__name__ in str(err)


@pytest.mark.parametrize("seconds", [MIN_COLLECTIVE_TIMEOUT_S, 0.5, 300, MAX_COLLECTIVE_TIMEOUT_S])
def test_collective_timeouts_in_bounds_are_taken(seconds):
    import datetime

    assert EngineConfig(collective_timeout_s=seconds).collective_timeout_s == seconds
    # what the ranks make of it: a timedelta of at least one whole millisecond
    assert datetime.timedelta(seconds=seconds) // datetime.timedelta(milliseconds=1) >= 1
