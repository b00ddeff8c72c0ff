"""GPU tier for the engine's fp8 KV cache (bf16 model, the compiled kernels): CUDA-graph replay
equals eager decode on the same fp8 cache, the kernels' decode over the engine's fp8 pages
equals the reference's on the same bytes (NaN-poisoned unused pages), greedy tokens stay close to
the bf16 cache's, chunked prefill over the dequantised prefix runs the Triton kernel, and the
scales keep their addresses (the graphs captured them). Runs the fp8 CUDA decode kernel
(`paged_decode` on fp8 pages: kernels.decode with an fp8 kv_dtype) and the fused rotary's fp8
write."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from sparsegen import ops, reference
from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import named_config, random_model
from sparsegen.testing import assert_close_rows

pytestmark = pytest.mark.gpu

PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    cfg = replace(named_config("tiny"), blocksparse_block_size=64)
    return random_model(cfg, device="cuda", dtype=torch.bfloat16, seed=5)


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (45, 130, 301)]


def engine(model, graphs: bool, kv: str = "fp8", **kw) -> LLMEngine:
    return LLMEngine(model, kv_cache_bytes=256 << 20, use_cuda_graphs=graphs, kv_cache_dtype=kv, **kw)


def test_graph_replay_equals_eager_on_an_fp8_cache(model, prompts):
    eager = [r.token_ids for r in engine(model, False).generate(prompts, PARAMS)]
    graphed = engine(model, True)
    ptrs = [s.k.data_ptr() for s in graphed.cache.scales]
    got = [r.token_ids for r in graphed.generate(prompts, PARAMS)]
    assert got == eager
    assert [s.k.data_ptr() for s in graphed.cache.scales] == ptrs  # calibrated in place
    assert all(s.ready for s in graphed.cache.scales)


SCORED = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)  # greedy, with the top-2 per step
NEAR_TIE = 0.25  # nats between the reference run's top two tokens: below it, a flip is rounding


def agreed_until_a_near_tie(got, want) -> tuple[list[str], int]:
    """Greedy runs `got` vs the reference runs `want` (RequestOutputs with top-2 logprobs): each
    must equal the reference token for token up to the reference's first near-tie step (top-1
    minus top-2 below NEAR_TIE), where bf16-level rounding of the K/V may pick either. Returns
    the disagreements found and how many tokens were compared."""
    bad, compared = [], 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        steps = w.outputs[0].logprobs
        until = next((j for j, s in enumerate(steps) if s.top[0][1] - s.top[1][1] < NEAR_TIE), len(steps))
        compared += until
        if g.token_ids[:until] != w.token_ids[:until]:
            bad.append(
                f"prompt {i}: {g.token_ids[:until]} != {w.token_ids[:until]} (first near-tie at {until})"
            )
    return bad, compared


def test_fp8_greedy_tokens_follow_the_bf16_caches_until_a_near_tie(model, prompts):
    bf16 = engine(model, True, "auto").generate(prompts, SCORED)
    fp8 = engine(model, True).generate(prompts, SCORED)
    bad, compared = agreed_until_a_near_tie(fp8, bf16)
    assert not bad and compared >= 3, (bad, compared)


def test_chunked_prefill_over_an_fp8_prefix(model, prompts):
    whole = engine(model, True).generate(prompts, SCORED)
    chunked = engine(model, True, max_num_batched_tokens=64).generate(prompts, SCORED)
    bad, compared = agreed_until_a_near_tie(chunked, whole)
    assert not bad and compared >= 3, (bad, compared)


def test_decode_kernel_equals_the_reference_on_the_engines_fp8_pages(model, prompts):
    eng = engine(model, False, async_decode=False)  # nothing in flight: the cache holds the prompts
    seqs = eng.submit(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    while any(s.t_first_token is None for s in seqs):
        eng.step()
    used = {p for s in seqs for p in s.pages}
    cache = eng.cache
    free = torch.tensor(sorted(set(range(cache.num_pages)) - used), device="cuda")
    for k in cache.k:  # pages no sequence holds: NaN, so a kernel that reads them shows it
        k[free] = torch.full_like(k[free], float("nan"))
    layer = model.spec.layers[0]
    width = max(len(s.pages) for s in seqs)
    tables = torch.tensor([s.pages + [0] * (width - len(s.pages)) for s in seqs], dtype=torch.int32,
                          device="cuda")  # fmt: skip
    lens = torch.tensor([len(s.prompt_ids) for s in seqs], dtype=torch.int32, device="cuda")  # written K/V
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(len(seqs), layer.num_heads, layer.head_dim, device="cuda", dtype=torch.bfloat16,
                    generator=gen)  # fmt: skip
    kc, vc, scales = cache.layers[0]
    out = ops.paged_decode(q, kc, vc, tables, lens, layer, impl="cuda", k_scale=scales.k, v_scale=scales.v)
    ref = reference.paged_decode(q, kc, vc, tables, lens, layer, k_scale=scales.k, v_scale=scales.v)
    assert torch.isfinite(out).all()
    assert_close_rows(out, ref, dtype=torch.bfloat16)
