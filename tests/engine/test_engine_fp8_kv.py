"""The engine on an fp8 KV cache (CPU, the tiny random model in float32, reference attention):
the cache's dtype and sizing, greedy tokens and next-token distributions against the float32
cache, chunked prefill over a dequantised fp8 prefix, scales from the first prefill or from a
checkpoint's `self_attn.k_scale` / `v_scale`, page accounting, and bad `kv_cache_dtype` values."""

from __future__ import annotations

import pytest
import torch
from helpers.checkpoint import write_checkpoint
from safetensors.torch import load_file, save_file

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.errors import InputError
from sparsegen.models import load_checkpoint
from sparsegen.models.config import CheckpointError
from sparsegen.runner.config import EngineConfig
from sparsegen.runner.model_runner import kv_bytes_per_page

pytestmark = pytest.mark.usefixtures("single_thread")

STEPS = 12
VOCAB = 272  # the tiny model's
# Mean KL(fp32 cache || fp8 cache) of the next-token distributions over the greedy steps. e4m3
# rounds each K/V element to 3 mantissa bits (relative error <= 1/16). Measured on this model
# and prompt: 3.1e-7 (e4m3), 1.4e-6 (e5m2), and 9.6e-3 when the scales are 4x too small (K/V
# saturate: the negative control below). The tiny random model's distributions are flat (top
# probability about 0.005), so the numbers are small; the bound sits 30x above e4m3's, 7x above
# e5m2's and ~1000x below the saturating control, so it separates a correct cache from a wrong one.
KL_BOUND = 1e-5


@pytest.fixture(scope="module")
def prompt():
    gen = torch.Generator().manual_seed(7)
    return torch.randint(0, 256, (90,), generator=gen).tolist()


class Run:
    """One greedy request's engine, output and next-token log-probabilities [STEPS, VOCAB] (the
    model's logits rows, recorded by a forward hook: one row a step for one sequence)."""

    def __init__(self, model, prompt, kv_cache_dtype="auto", chunk=4096, tweak=None):
        self.engine = LLMEngine(model, kv_cache_bytes=1 << 22, max_num_batched_tokens=chunk, page_size=16,
                                kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        if tweak is not None:
            tweak(self.engine)
        rows = []
        hook = model.register_forward_hook(lambda m, args, out: rows.append(out.detach().double()))
        try:
            self.out = self.engine.generate([prompt], SamplingParams(max_tokens=STEPS, ignore_eos=True))[0]
        finally:
            hook.remove()
        logits = torch.cat(rows)  # [STEPS, VOCAB]
        assert logits.shape == (STEPS, VOCAB)
        self.logp = torch.log_softmax(logits, dim=-1)
        self.cache = self.engine.cache


def mean_kl(p_log: torch.Tensor, q_log: torch.Tensor) -> float:
    return float((p_log.exp() * (p_log - q_log)).sum(-1).mean())


@pytest.fixture(scope="module")
def fp32_run(model, prompt):
    return Run(model, prompt)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
def test_fp8_greedy_tokens_and_distributions_match_the_fp32_cache(model, prompt, fp32_run, name):
    out = Run(model, prompt, name)
    cache = out.cache
    assert cache.k[0].dtype == torch.float8_e4m3fn and cache.v[-1].dtype == torch.float8_e4m3fn
    assert all(s.ready for s in cache.scales)  # set by the first prefill
    ref = fp32_run
    assert out.out.token_ids[:8] == ref.out.token_ids[:8]
    kl = mean_kl(ref.logp, out.logp)
    assert 0 < kl < KL_BOUND, kl  # > 0: the cache really is quantised


def quarter_after_calibration(engine):
    """Every layer's calibrated scales divided by 4, so the largest K/V values clip at ±448 in
    the cache (written and read with the same wrong scales)."""
    for s in engine.cache.scales:
        orig = s.calibrate

        def calibrate(k, v, s=s, orig=orig):
            orig(k, v)
            s.k.mul_(0.25)
            s.v.mul_(0.25)

        s.calibrate = calibrate


def test_kl_bound_catches_saturating_scales(model, prompt, fp32_run):
    """The negative control: the scales 4x too small."""
    out = Run(model, prompt, "fp8", tweak=quarter_after_calibration)
    kl = mean_kl(fp32_run.logp, out.logp)
    assert kl > 100 * KL_BOUND, kl


def test_fp8_e5m2_runs_and_stays_close(model, prompt, fp32_run):
    out = Run(model, prompt, "fp8_e5m2")
    assert out.cache.k[0].dtype == torch.float8_e5m2
    assert 0 < mean_kl(fp32_run.logp, out.logp) < KL_BOUND


def test_chunked_prefill_reads_the_dequantised_fp8_prefix(model, prompt, fp32_run):
    """32-token chunks: every chunk after the first attends to the fp8 cache through the
    dequantising gather."""
    out = Run(model, prompt, "fp8", chunk=32)
    ref = fp32_run
    assert out.out.token_ids[:8] == ref.out.token_ids[:8]
    assert mean_kl(ref.logp, out.logp) < KL_BOUND


def test_scales_are_computed_once(model, prompt):
    engine = Run(model, prompt, "fp8").engine
    first = [s.k.clone() for s in engine.cache.scales]
    ptrs = [s.k.data_ptr() for s in engine.cache.scales]
    engine.generate([[x * 3 % 256 for x in prompt]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert all(torch.equal(a, s.k) for a, s in zip(first, engine.cache.scales, strict=True))
    assert [s.k.data_ptr() for s in engine.cache.scales] == ptrs
    assert all(bool((s.k != 1.0).all()) for s in engine.cache.scales)  # not the placeholder ones


def test_page_accounting_fp8_holds_four_times_fp32s_tokens(model, prompt):
    fp8, f32 = Run(model, prompt, "fp8"), Run(model, prompt)
    assert kv_bytes_per_page(model, 16, torch.float8_e4m3fn) * 4 == kv_bytes_per_page(model, 16)
    assert kv_bytes_per_page(model, 16, torch.float8_e4m3fn) * 2 == kv_bytes_per_page(
        model, 16, torch.bfloat16
    )
    assert fp8.cache.num_pages == 4 * f32.cache.num_pages  # the same 4 MiB
    assert fp8.cache.allocator.num_free == fp8.cache.allocator.capacity  # every page came back
    assert len(fp8.out.token_ids) == STEPS


def test_huge_activations_give_finite_outputs(model, prompt):
    """Scales forced to 1e-30 (no calibration): every K/V element saturates at ±448 in the cache,
    and the engine still samples from finite distributions."""

    def tiny_scales(engine):
        for s in engine.cache.scales:
            s.set(torch.tensor(1e-30), torch.tensor(1e-30))

    out = Run(model, prompt, "fp8", chunk=32, tweak=tiny_scales)
    assert out.cache.k[0].float().abs().max() == 448.0
    assert torch.isfinite(out.logp).all()


@pytest.fixture(scope="module")
def scaled_checkpoint(tmp_path_factory):
    """The tiny checkpoint plus vLLM-style scales: a scalar k_scale and a per-head v_scale per layer."""
    folder = write_checkpoint(tmp_path_factory.mktemp("fp8ckpt") / "ckpt")
    tensors = load_file(str(folder / "model.safetensors"))
    cfg = load_checkpoint(folder, dtype=torch.float32).config
    for i in range(cfg.num_hidden_layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.01 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.arange(1, cfg.num_key_value_heads + 1) * 0.02
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, cfg


def test_checkpoint_scales_are_used(scaled_checkpoint, prompt):
    folder, cfg = scaled_checkpoint
    model = load_checkpoint(folder, dtype=torch.float32, attn_impl="reference")
    out = Run(model, prompt, "fp8")
    for i, s in enumerate(out.cache.scales):
        assert torch.allclose(s.k, torch.full((cfg.num_key_value_heads,), 0.01 * (i + 1)))
        assert torch.allclose(s.v, torch.arange(1, cfg.num_key_value_heads + 1) * 0.02)
    assert len(out.out.token_ids) == STEPS
    bf = LLMEngine(model, kv_cache_bytes=1 << 22)  # a float cache ignores them
    assert bf.cache.scales[0] is None


def test_checkpoint_with_one_of_the_two_scales_is_refused(scaled_checkpoint, tmp_path):
    folder, _ = scaled_checkpoint
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.self_attn.v_scale"]
    bad = write_checkpoint(tmp_path / "bad", tensors=tensors)
    with pytest.raises(CheckpointError, match="layer 1 but not 'model.layers.1.self_attn.v_scale'"):
        load_checkpoint(bad, dtype=torch.float32)


@pytest.mark.parametrize("value", ["fp16", "FP8", "float8_e4m3fn", "", None, 8, torch.float8_e4m3fn])
def test_bad_kv_cache_dtype_is_refused(value):
    with pytest.raises(InputError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype=value)


def test_fp8_with_tensor_parallelism_is_refused():
    with pytest.raises(InputError, match="tensor_parallel_size"):
        EngineConfig(kv_cache_dtype="fp8", tensor_parallel_size=2)


def test_engine_refuses_a_bad_kv_cache_dtype_before_allocating(model):
    with pytest.raises(InputError, match="kv_cache_dtype"):
        LLMEngine(model, kv_cache_dtype="int8")


# The families' tiny models attend more sharply than the Phi-3-Small one. Measured mean KL of
# fp8 against the fp32 cache over the steps whose context still agrees: 9.6e-4 (llama, whole
# prompt, 12 steps), 2.0e-3 (llama, 32-token chunks, 1 step: its first token flips on a near
# tie), 9.8e-4 and 1.0e-3 (mistral); with K/V scales 4x too small (saturating) 0.09-0.35. The
# bound sits 5x above the largest and 9x below the smallest saturating one.
FAMILY_KL_BOUND = 1e-2


def same_context_kl(ref: Run, out: Run) -> tuple[float, int]:
    """Mean KL over the steps whose earlier tokens agree (the same context: teacher-forced in
    effect), and how many steps that is. After an argmax flip the contexts differ."""
    n = 1
    while n < STEPS and ref.out.token_ids[n - 1] == out.out.token_ids[n - 1]:
        n += 1
    return mean_kl(ref.logp[:n], out.logp[:n]), n


@pytest.mark.parametrize("family, extra", [("llama", {}), ("mistral", {"sliding_window": 8})])
@pytest.mark.parametrize("chunk", [4096, 32])
def test_a_decoder_family_runs_on_an_fp8_cache(family, extra, chunk):
    """The families' attention (models.families.blocks) quantises, calibrates and dequantises too;
    with 32-token chunks the prefill reads the fp8 prefix (the first chunk sets the scales, so a
    later outlier saturates, as with vLLM's first-batch calibration)."""
    from sparsegen.models import random_model
    from sparsegen.models.families import config_from_dict

    cfg = config_from_dict({"model_type": family, "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
                            "tie_word_embeddings": False, **extra})  # fmt: skip
    fam = random_model(cfg, seed=1, attn_impl="reference")
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (70,), generator=gen).tolist()
    ref, out = Run(fam, prompt), Run(fam, prompt, "fp8", chunk=chunk)
    assert out.cache.k[0].dtype == torch.float8_e4m3fn and all(s.ready for s in out.cache.scales)
    kl, steps = same_context_kl(ref, out)
    assert 0 < kl < FAMILY_KL_BOUND, (kl, steps)
    wrong = Run(fam, prompt, "fp8", chunk=chunk, tweak=quarter_after_calibration)  # the negative control
    assert same_context_kl(ref, wrong)[0] > FAMILY_KL_BOUND


@pytest.mark.slow  # dynamo traces the decode step (aot_eager: no codegen), several seconds
def test_compiled_decode_on_an_fp8_cache_equals_eager(monkeypatch, model, prompt):
    from sparsegen.runner import model_runner

    monkeypatch.setattr(model_runner, "COMPILE_BACKEND", "aot_eager")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    eager = LLMEngine(model, kv_cache_bytes=1 << 22, kv_cache_dtype="fp8").generate([prompt], params)
    compiled = LLMEngine(model, kv_cache_bytes=1 << 22, kv_cache_dtype="fp8", compile_model=True)
    assert compiled.generate([prompt], params)[0].token_ids == eager[0].token_ids


def test_prefix_caching_reads_the_cached_fp8_pages(model, prompt, fp32_run):
    """A repeated prompt's cached pages are fp8 (the cache salt keeps them apart from float
    pages): its prefill reads them through the dequantising gather and samples the same tokens."""
    engine = LLMEngine(model, kv_cache_bytes=1 << 22, kv_cache_dtype="fp8", enable_prefix_caching=True)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    first = engine.generate([prompt], params)[0]
    again = engine.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16 * (len(prompt) // 16 - 1)
    assert again.token_ids[:8] == first.token_ids[:8] == fp32_run.out.token_ids[:8]
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity
