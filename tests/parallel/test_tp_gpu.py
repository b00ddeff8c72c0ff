"""Tensor parallelism on GPUs (NCCL): tokens equal one GPU's, collectives inside CUDA graphs.

Needs at least 2 GPUs:  PYTHONPATH=$PWD python -m pytest -q -m gpu tests/parallel/test_tp_gpu.py
"""

from __future__ import annotations

import gc

import pytest
import torch
from helpers import extras
from helpers.tp import rank_facts

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import random_model
from sparsegen.parallel.rank import RankContext
from sparsegen.parallel.source import ModelSource

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs >= 2 CUDA GPUs"),
]

KV_BYTES = 8 << 30  # explicit: one GPU also holds the single-GPU reference
ENGINE = dict(kv_cache_bytes=KV_BYTES, max_num_seqs=8, max_num_batched_tokens=4096)


def _prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _one_gpu(size, prompts, params, graphs=True):
    model = random_model(size, device="cuda", dtype=torch.bfloat16, seed=0, triton_gemv=False)  # as the ranks
    engine = LLMEngine(model, use_cuda_graphs=graphs, **ENGINE)
    out = [r.token_ids for r in engine.generate(prompts, params)]
    del engine  # free GPU 0 for rank 0
    gc.collect()
    torch.cuda.empty_cache()
    return out


def graph_counts(ctx: RankContext) -> int:
    graphs = ctx.runner.graphs
    return 0 if graphs is None else len(graphs.graphs)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_random_7b_greedy_tokens_equal_one_gpu_for_32_steps(tp):
    if torch.cuda.device_count() < tp:
        pytest.skip(f"TP={tp} needs {tp} GPUs, {torch.cuda.device_count()} visible")
    prompts = _prompts([2500, 1500, 300, 40])  # past 1024 tokens the sparse layers differ from dense
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    want = _one_gpu("7b", prompts, params)
    source = ModelSource(random="7b", dtype="bfloat16", seed=0)
    with LLMEngine(source, tensor_parallel_size=tp, device="cuda", **ENGINE) as engine:
        got = [r.token_ids for r in engine.generate(prompts, params)]
        facts = engine.executor.call(rank_facts)
        counts = engine.executor.call(graph_counts)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        first = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
        assert first is None, (
            f"prompt {i}: TP={tp} differs from one GPU at step {first}: {a[first]} vs {b[first]}"
        )
    heads = 32 // tp
    for f in facts:
        r = f["rank"]
        assert f["offsets"][0] == [h % 8 for h in range(r * heads, (r + 1) * heads)]  # global h % 8
        assert f["kv_cache_shape"][2] == 8 // tp
    assert counts > 0  # decode steps replayed CUDA graphs that hold the all-reduces and the gather


def test_tp2_cuda_graph_replays_equal_eager_steps():
    prompts = _prompts([1200, 64, 700], seed=1)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    source = ModelSource(random="7b", dtype="bfloat16", seed=0)
    out = {}
    for graphs in (False, True):
        with LLMEngine(
            source, tensor_parallel_size=2, device="cuda", use_cuda_graphs=graphs, **ENGINE
        ) as engine:
            out[graphs] = [r.token_ids for r in engine.generate(prompts, params)]
            assert (engine.executor.call(graph_counts) > 0) == graphs
    assert out[True] == out[False]


def test_serve_tp2_over_http_equals_offline_generate():
    """`sparsegen serve --tp 2`'s engine on GPUs: a request over HTTP gives the tokens that
    `LLM.generate` gives on the same tensor-parallel engine, and /metrics reads rank 0's cache."""
    httpx = extras.require("httpx")
    extras.require("fastapi")
    from sparsegen import LLM
    from sparsegen.serve.server import ServerThread

    llm = LLM(random="7b", device="cuda", tensor_parallel_size=2, **ENGINE)
    try:
        prompt = _prompts([1500], seed=2)[0]
        params = SamplingParams(max_tokens=16, ignore_eos=True)
        want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        with ServerThread(llm) as srv:
            body = {"model": "random-7b", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}  # fmt: skip
            res = httpx.post(srv.url + "/v1/completions", json=body, timeout=300)
            assert res.status_code == 200, res.text
            assert res.json()["choices"][0]["token_ids"] == want
            total = [ln for ln in httpx.get(srv.url + "/metrics", timeout=30).text.splitlines()
                     if ln.startswith("sparsegen_kv_pages_total ")]  # fmt: skip
            assert float(total[0].split()[1]) == llm.engine.kv_capacity[0] > 0
    finally:
        llm.close()
