"""`logit_bias` and `allowed_token_ids` through the server: the generated tokens obey them."""

from __future__ import annotations

import pytest
from helpers import extras

extras.require("httpx")
extras.require("fastapi")
from helpers.serve import OK, all_pages_free  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_thread")


def _tokens(http, **extra) -> list[int]:
    body = {**OK, "max_tokens": 6, "temperature": 1.0, "seed": 3, "return_token_ids": True, **extra}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text[:300]
    return r.json()["choices"][0]["token_ids"]


def test_allowed_token_ids_bound_every_sampled_token(http, server):
    allowed = [65, 66, 67]
    toks = _tokens(http, allowed_token_ids=allowed, ignore_eos=True)
    assert len(toks) == 6 and set(toks) <= set(allowed), toks
    assert all_pages_free(server)


def test_logit_bias_plus_100_wins_and_minus_100_bans(http, server):
    assert _tokens(http, logit_bias={"70": 100}, ignore_eos=True) == [70] * 6
    free = _tokens(http, ignore_eos=True)
    banned = {str(t): -100 for t in set(free)}
    assert not set(_tokens(http, logit_bias=banned, ignore_eos=True)) & set(free)
    assert all_pages_free(server)
