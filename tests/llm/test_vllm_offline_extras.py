"""vLLM-style offline code for the small items: `SamplingParams(spaces_between_special_tokens=...)`
through `LLM.generate`, and `LLM(gpu_memory_utilization=...)` (checked; not used on a CPU)."""

from __future__ import annotations

import pytest

from sparsegen import LLM, SamplingParams
from sparsegen.errors import InputError

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def llm():
    return LLM(random="tiny", gpu_memory_utilization=0.5)


def test_spaces_between_special_tokens_offline(llm):
    tok = llm.tokenizer
    user, end = tok.special_tokens["<|user|>"], tok.special_tokens["<|end|>"]
    a, b = tok.encode("a")[0], tok.encode("b")[0]
    # sampled (seeded) among two special and two text tokens: the order is the model's and the
    # seed's, the spacing is the detokenizer's
    base = dict(max_tokens=8, ignore_eos=True, skip_special_tokens=False, temperature=1.0, seed=11)
    outs = {}
    for spaced in (True, False):
        p = SamplingParams(**base, spaces_between_special_tokens=spaced, allowed_token_ids=[user, end, a, b])
        outs[spaced] = llm.generate([[a, b]], p, use_tqdm=False)[0]
    assert outs[True].token_ids == outs[False].token_ids
    ids = outs[True].token_ids
    assert {user, end} & set(ids) and {a, b} & set(ids), ids  # both kinds came: the case is tested
    names = {user: "<|user|>", end: "<|end|>", a: "a", b: "b"}
    pieces = [names[t] for t in outs[True].token_ids]
    assert outs[False].text == "".join(pieces)
    # with spaces: a space wherever a special token meets another piece
    want = pieces[0]
    for cur, t_prev, t_cur in zip(pieces[1:], ids, ids[1:]):
        want += (" " if t_prev in (user, end) or t_cur in (user, end) else "") + cur
    assert outs[True].text == want
    hidden = llm.generate([[a, b]], SamplingParams(max_tokens=4, ignore_eos=True, allowed_token_ids=[user, a]),
                          use_tqdm=False)[0]  # fmt: skip
    assert " " not in hidden.text  # skipped special tokens leave no spaces


def test_gpu_memory_utilization_is_an_engine_option(llm):
    assert llm.engine.config.gpu_memory_utilization == 0.5
    with pytest.raises(InputError, match="gpu_memory_utilization"):
        LLM(random="tiny", gpu_memory_utilization=1.5)
