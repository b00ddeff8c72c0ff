"""The server takes a decoder family unchanged: a tiny Gemma-2 checkpoint (windows, soft-caps,
no tokenizer) served, its greedy completion of token ids equal to transformers' `generate`."""

from __future__ import annotations

import pytest
from helpers import extras
from helpers.hf_families import hf_greedy, write_family_checkpoint

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.slow  # ~9 s: transformers' first Gemma-2 build in a process dominates
def test_served_gemma2_completes_like_transformers(tmp_path):
    extras.require("fastapi")
    extras.require("transformers")
    httpx = extras.require("httpx")
    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    folder, hf = write_family_checkpoint(tmp_path / "ckpt", "gemma2")
    prompt = [(7 * i + 3) % 90 + 1 for i in range(20)]
    with ServerThread(
        LLM(model=folder, device="cpu", dtype="float32", max_num_seqs=2, num_pages=16, max_model_len=64),
        max_queue=4,
    ) as srv:
        body = {"model": str(folder), "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]
    assert tokens == [f"token_id:{t}" for t in hf_greedy(hf, prompt, 5)]
