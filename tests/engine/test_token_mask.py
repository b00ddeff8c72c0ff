"""Grammar masks on the logits (`runner.token_mask`) and in the batched sampler: against a
by-hand per-row reference, with constrained and free rows, greedy and sampled, mixed with
logit_bias / allowed_token_ids / min_tokens, and a row no token satisfies failing alone."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparsegen.errors import InputError
from sparsegen.request.sampling_params import SamplingParams
from sparsegen.request.structured_outputs import StructuredOutputsParams
from sparsegen.runner.isolation import sample_isolating
from sparsegen.runner.sampling import sample
from sparsegen.runner.token_mask import allowed_ids, apply_token_bitmask, words_for

V = 100  # not a multiple of 32: the last word is partly past the vocabulary
C = StructuredOutputsParams(regex="a")  # any constraint: the mask is what the sampler reads


def _bitmask(allowed_per_row: list[list[int] | None], v: int = V) -> torch.Tensor:
    """[B, W] int32 with the given ids set (None: a free row, left 0)."""
    mask = np.zeros((len(allowed_per_row), words_for(v) * 32), dtype=np.uint8)
    for r, ids in enumerate(allowed_per_row):
        if ids is not None:
            mask[r, ids] = 1
    packed = np.packbits(mask, axis=1, bitorder="little").view("<i4")
    return torch.from_numpy(packed.copy()).to(torch.int32)


def _reference(row: torch.Tensor, allowed: list[int] | None) -> torch.Tensor:
    out = row.clone()
    if allowed is not None:
        for t in range(out.shape[0]):
            if t not in allowed:
                out[t] = -math.inf
    return out


def _allowed(seed: int, b: int) -> list[list[int] | None]:
    gen = np.random.default_rng(seed)
    rows: list[list[int] | None] = []
    for r in range(b):
        if r % 3 == 2:
            rows.append(None)  # a free row in between
        else:
            rows.append(sorted(gen.choice(V, size=int(gen.integers(1, 12)), replace=False).tolist()))
    return rows


def test_bits_round_trip_and_high_ids_are_never_allowed():
    ids = [0, 1, 31, 32, 63, 64, 99]
    mask = _bitmask([ids])
    assert allowed_ids(mask[0].numpy(), V).tolist() == ids
    # a row whose words reach past V: those ids are cut
    assert allowed_ids(mask[0].numpy(), 64).tolist() == [0, 1, 31, 32, 63]


@pytest.mark.parametrize("seed", range(4))
def test_apply_matches_the_per_row_reference(seed):
    b = 7
    x = torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 4
    allowed = _allowed(seed, b)
    params = [SamplingParams(structured_outputs=C) if a is not None else SamplingParams() for a in allowed]
    out = apply_token_bitmask(x, _bitmask(allowed), params)
    for r in range(b):
        torch.testing.assert_close(out[r], _reference(x[r], allowed[r]), rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(4))
def test_greedy_and_sampled_rows_stay_inside_their_masks(seed):
    b = 9
    x = torch.randn(b, V, generator=torch.Generator().manual_seed(100 + seed)) * 4
    allowed = _allowed(seed, b)
    params = []
    for r, a in enumerate(allowed):
        so = C if a is not None else None
        params.append(
            SamplingParams(structured_outputs=so, temperature=0.0 if r % 2 else 1.0, seed=seed * 10 + r)
        )
    out = sample(x, params, [[] for _ in range(b)], token_bitmask=_bitmask(allowed))
    for r, (tok, a) in enumerate(zip(out.token_ids, allowed, strict=True)):
        if a is not None:
            assert tok in a, (r, tok, a)
        if params[r].greedy:
            assert tok == int(_reference(x[r], a).argmax())
    # the free rows sample exactly as without any mask in the batch
    free = [r for r, a in enumerate(allowed) if a is None]
    alone = sample(x[free], [params[r] for r in free], [[] for _ in free])
    assert alone.token_ids == [out.token_ids[r] for r in free]


def test_mask_and_logit_processors_compose():
    x = torch.zeros(2, V)
    x[:, 5] = 10.0  # the best token, outside both masks
    allowed = [[1, 2, 3], [1, 2, 3]]
    params = [
        SamplingParams(structured_outputs=C, logit_bias={3: 50.0}),
        SamplingParams(structured_outputs=C, allowed_token_ids=[2, 5]),
    ]
    out = sample(x, params, [[], []], token_bitmask=_bitmask(allowed))
    assert out.token_ids == [3, 2]  # biased inside the mask; the intersection {2}


def test_min_tokens_does_not_ban_the_only_allowed_tokens():
    eos = 7
    x = torch.zeros(2, V)
    x[:, 9] = 5.0
    params = [SamplingParams(structured_outputs=C, min_tokens=4)] * 2
    # row 0: the grammar allows EOS and 8 -> EOS banned, 8 taken; row 1: only EOS -> kept
    out = sample(x, params, [[], []], token_bitmask=_bitmask([[eos, 8], [eos]]), eos_token_id=eos)
    assert out.token_ids == [8, eos]


def test_a_constrained_row_needs_its_mask():
    with pytest.raises(InputError, match="without its grammar mask"):
        sample(torch.zeros(1, V), [SamplingParams(structured_outputs=C)], [[]])


def test_a_row_no_token_satisfies_fails_alone():
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(structured_outputs=C),
        SamplingParams(structured_outputs=C),  # an empty mask
        SamplingParams(structured_outputs=C, allowed_token_ids=[50]),  # disjoint from its mask
    ]
    mask = _bitmask([[4, 5], [], [1, 2]])
    out = sample_isolating(x, params, [[]] * 3, [[1]] * 3, eos_token_id=None, num_generated=[0] * 3,
                           token_bitmask=mask).output()  # fmt: skip
    assert dict(out.failed).keys() == {1, 2}
    assert "allows no next token" in dict(out.failed)[1]
    assert "allowed_token_ids and its grammar" in dict(out.failed)[2]
    assert out.token_ids[0] in (4, 5)
