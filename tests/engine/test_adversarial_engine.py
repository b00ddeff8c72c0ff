"""Adversarial inputs to the engine (CPU, tiny model): every bad argument is a typed error raised
before anything is queued or allocated, and no failure strands a request or a KV page.

After each failure the engine must be idle with every page free, `warmup()` must work, and a
fresh request must give the same tokens as on an engine that never failed.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from sparsegen import CacheOutOfMemory, InputError, MemoryLimitError
from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.models import memory, named_config, random_model

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 272  # the tiny model's
PARAMS = SamplingParams(max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine(model, num_pages=40, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def baseline(model):
    """Tokens of two fixed requests on an engine that never saw a failure."""
    return [r.token_ids for r in LLMEngine(model).generate([[5, 6, 7], [8] * 20], PARAMS)]


def assert_clean(engine, baseline):
    alloc = engine.cache.allocator
    assert not engine.has_unfinished
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert alloc.num_free == alloc.capacity
    assert engine.warmup() > 0
    events = list(engine.stream([[5, 6, 7], [8] * 20], PARAMS))
    for i, want in enumerate(baseline):
        mine = [e for e in events if e.index == i]
        assert [e.token_id for e in mine] == want
        assert [e.finish_reason is not None for e in mine] == [False] * (len(want) - 1) + [True]
    assert alloc.num_free == alloc.capacity


# -- atomic submission ----------------------------------------------------------------------------
BAD_PROMPTS = [
    [-1],
    [VOCAB],
    [1, True, 2],
    [False],
    [1.0],
    [1, 2.5],
    ["1"],
    [None],
    [torch.tensor(3)],
    [],
    "abc",
    b"ab",
    None,
    7,
    (1, [2]),
    [2**70],
    [1] * 4096,  # reaches max_model_len
]


@pytest.mark.parametrize("bad", BAD_PROMPTS, ids=lambda b: repr(b)[:20])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_a_bad_prompt_anywhere_queues_nothing(engine, baseline, bad, where):
    prompts = [[1, 2], [3, 4]]
    prompts.insert(where, bad)
    with pytest.raises(InputError) as err:
        engine.generate(prompts, PARAMS)
    assert f"prompt {where}" in str(err.value)
    assert not engine.has_unfinished and engine.cache.allocator.num_free == engine.cache.allocator.capacity
    with pytest.raises(InputError):
        list(engine.stream(prompts, PARAMS))
    with pytest.raises(InputError):
        engine.submit(prompts, PARAMS)
    assert not engine.has_unfinished
    if where == 2:
        assert_clean(engine, baseline)


def _params(**kw):
    """A SamplingParams holding exactly these values, even where its own checks would refuse
    them (a caller can always bypass __post_init__)."""
    p = SamplingParams()
    for k, v in kw.items():
        object.__setattr__(p, k, v)
    return p


BAD_PARAMS = [
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", -1.0),
    ("temperature", "0.5"),
    ("temperature", True),
    ("top_p", math.nan),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", 1.5),
    ("top_k", True),
    ("seed", 2**70),
    ("seed", -1),
    ("seed", "1"),
    ("seed", 1.5),
    ("seed", True),
    ("stop_token_ids", "abc"),
    ("stop_token_ids", ("a", "b")),
    ("stop_token_ids", (1.5,)),
    ("stop_token_ids", (True,)),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", (VOCAB,)),
    ("stop_token_ids", 5),
    ("max_tokens", 0),
    ("max_tokens", 1.5),
    ("max_tokens", True),
    ("ignore_eos", "yes"),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS, ids=lambda x: repr(x)[:16])
def test_bad_sampling_params_are_refused_before_queueing(engine, field, value):
    good = SamplingParams(max_tokens=3)
    try:  # SamplingParams itself may refuse it already; either way it is an InputError
        bad = SamplingParams(**{field: value})
    except InputError:
        bad = _params(**{field: value})
    with pytest.raises(InputError, match=field):
        engine.generate([[1, 2], [3, 4], [5]], [good, good, bad])
    with pytest.raises(InputError, match=field):
        engine.add_request([1, 2], bad)
    assert not engine.has_unfinished
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


@pytest.mark.parametrize("index", ["0", 1.0, True, [1]])
def test_add_request_index_must_be_an_int(engine, index):
    with pytest.raises(InputError, match="index"):
        engine.add_request([1, 2], PARAMS, index=index)
    assert not engine.has_unfinished


@pytest.mark.parametrize(
    "params", [[PARAMS], [PARAMS] * 3, {"max_tokens": 3}, None, "greedy", [PARAMS, {"max_tokens": 3}]]
)
def test_params_must_be_one_or_one_per_prompt(engine, params):
    with pytest.raises(InputError):
        engine.generate([[1, 2], [3, 4]], params)
    assert not engine.has_unfinished


def test_a_request_too_large_for_the_cache_queues_nothing(engine, baseline):
    huge = SamplingParams(max_tokens=4000, ignore_eos=True)  # 4000 tokens > 39 pages of 16
    with pytest.raises(CacheOutOfMemory, match="KV pages"):
        engine.generate([[1, 2], [3, 4]], [PARAMS, huge])
    assert_clean(engine, baseline)


# -- aborts and failures ---------------------------------------------------------------------------
def test_abort_a_waiting_and_a_running_request(model, baseline):
    engine = LLMEngine(model, num_pages=40, max_num_seqs=1)
    a, b = engine.submit([[5, 6, 7], [9, 9]], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert a in engine.scheduler.running and b in engine.scheduler.waiting and a.pages
    assert engine.abort(b.seq_id) and b.finish_reason == "abort"
    assert engine.abort(a.seq_id) and a.finish_reason == "abort" and not a.pages
    for rid in (a.seq_id, b.seq_id, 12345, -1, "0", None, 1.0):
        assert engine.abort(rid) is False
    assert engine.step() == []
    assert_clean(engine, baseline)


def test_abort_one_of_a_batch_leaves_the_others_exact(model, baseline):
    engine = LLMEngine(model, num_pages=40, max_num_seqs=4)
    seqs = engine.submit([[5, 6, 7], [1] * 30, [8] * 20], PARAMS)
    engine.step()  # prefill
    engine.abort(seqs[1].seq_id)
    while engine.has_unfinished:
        engine.step()
    assert seqs[0].output_ids == baseline[0] and seqs[2].output_ids == baseline[1]
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


class Boom(Exception):
    pass


@pytest.mark.parametrize("after", [1, 2, 5, 7])
def test_an_exception_in_on_token_aborts_the_call(engine, baseline, after):
    seen = []

    def on_token(event):
        seen.append(event)
        if len(seen) == after:
            raise Boom

    with pytest.raises(Boom):
        engine.generate([[1, 2, 3], [4] * 17, [5] * 33], SamplingParams(max_tokens=6), on_token=on_token)
    assert len(seen) == after
    assert_clean(engine, baseline)


@pytest.mark.parametrize("fail_at", [0, 1, 3])
def test_an_exception_in_the_forward_pass_aborts_the_call(model, baseline, fail_at):
    engine = LLMEngine(model, num_pages=40, max_num_batched_tokens=16)
    forward, calls = engine.runner.run, []

    def flaky(plan):
        calls.append(plan)
        if len(calls) == fail_at + 1:
            raise Boom
        return forward(plan)

    engine.runner.run = flaky
    with pytest.raises(Boom):
        engine.generate([[1] * 40, [2, 3]], PARAMS)
    engine.runner.run = forward
    assert_clean(engine, baseline)


def test_a_stream_closed_early_aborts_its_requests(engine, baseline):
    it = engine.stream([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=20, ignore_eos=True))
    first = [next(it) for _ in range(3)]
    assert len(first) == 3 and engine.has_unfinished
    it.close()
    assert_clean(engine, baseline)


def test_a_stream_only_yields_its_own_requests(model, baseline):
    engine = LLMEngine(model, num_pages=40)
    other = engine.add_request([1, 2], SamplingParams(max_tokens=8, ignore_eos=True))
    events = list(engine.stream([[5, 6, 7]], PARAMS))
    assert {e.index for e in events} == {0} and [e.token_id for e in events] == baseline[0]
    assert all(e.request_id != other.seq_id for e in events)
    while engine.has_unfinished:
        engine.step()
    assert len(other.output_ids) == 8


def test_warmup_refuses_a_busy_engine_and_leaves_its_requests(engine):
    seq = engine.add_request([1, 2], PARAMS)
    with pytest.raises(RuntimeError, match="pending"):
        engine.warmup()
    assert engine.abort(seq.seq_id)
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


# -- engine arguments ---------------------------------------------------------------------------
BAD_ENGINE_ARGS = [
    ("page_size", 0),
    ("page_size", -16),
    ("page_size", 16.5),
    ("page_size", True),
    ("page_size", "16"),
    ("page_size", 129),
    ("num_pages", 0),
    ("num_pages", 1),
    ("num_pages", -4),
    ("num_pages", 64.0),
    ("num_pages", True),
    ("kv_cache_bytes", 0),
    ("kv_cache_bytes", -1),
    ("kv_cache_bytes", 1.5e6),
    ("kv_cache_bytes", 100),  # less than two pages
    ("max_num_seqs", 0),
    ("max_num_seqs", -1),
    ("max_num_seqs", 2.0),
    ("max_num_batched_tokens", 0),
    ("max_num_batched_tokens", None),
    ("max_model_len", 0),
    ("max_model_len", -5),
    ("max_model_len", 1),
    ("max_model_len", 100.0),
    ("max_model_len", True),
    ("max_model_len", 4097),  # past the model's max_position_embeddings
    ("use_cuda_graphs", 1),
    ("use_cuda_graphs", "no"),
    ("compile_model", 1),
    ("compile_model", "yes"),
    ("kv_layout", "Head"),
    ("kv_layout", None),
    ("kv_layout", ("head",)),
]


@pytest.mark.parametrize("name,value", BAD_ENGINE_ARGS, ids=lambda x: repr(x)[:16])
def test_bad_engine_arguments_are_input_errors_naming_them(model, name, value):
    field = "kv_cache_bytes" if name == "kv_cache_bytes" else name
    with pytest.raises(InputError, match=field):
        LLMEngine(model, **{name: value})


@pytest.mark.parametrize("model_arg", [None, "tiny", torch.nn.Linear(2, 2)])
def test_engine_needs_a_model(model_arg):
    with pytest.raises(InputError, match="model"):
        LLMEngine(model_arg)


def test_good_edge_arguments_work(model):
    engine = LLMEngine(
        model, page_size=1, num_pages=2000, max_num_seqs=1, max_num_batched_tokens=1, max_model_len=8
    )
    (res,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(res.token_ids) == 5 and res.finish_reason == "length"  # 3 + 5 = max_model_len
    assert engine.cache.allocator.num_free == engine.cache.allocator.capacity


# -- memory estimates -------------------------------------------------------------------------------
def test_7b_on_a_small_cpu_fails_from_the_estimate(monkeypatch):
    monkeypatch.setattr(memory, "cpu_available_bytes", lambda: 8 << 30)
    with pytest.raises(MemoryLimitError, match=r"weights \(7\.80 B parameters.*GiB"):
        random_model("7b", device="cpu")


def test_kv_cache_larger_than_memory_fails_from_the_estimate(model, monkeypatch):
    monkeypatch.setattr(memory, "cpu_available_bytes", lambda: 1 << 30)
    with pytest.raises(MemoryLimitError, match="KV cache of 1000000 pages"):
        LLMEngine(model, num_pages=1_000_000)


def test_a_prefill_step_too_big_for_memory_fails_from_the_estimate(model, monkeypatch):
    """A KV cache that fits, but not with one prefill step's activations beside it: refused at
    construction, naming the step's tokens and max_num_batched_tokens; a smaller step fits."""
    from sparsegen.runner.model_runner import kv_bytes_per_page

    pages = 64
    kv = pages * kv_bytes_per_page(model, 16)
    act = memory.prefill_activation_bytes(model.config, model.dtype, 4096)
    free = int((kv + act // 2) / memory.USABLE_FRACTION)  # KV and half of a 4096-token step
    monkeypatch.setattr(memory, "cpu_available_bytes", lambda: free)
    with pytest.raises(MemoryLimitError, match=r"prefill step of 4096 tokens.*max_num_batched_tokens"):
        LLMEngine(model, num_pages=pages, max_num_batched_tokens=4096, max_model_len=4096)
    engine = LLMEngine(model, num_pages=pages, max_num_batched_tokens=1024, max_model_len=4096)
    assert engine.config.max_num_batched_tokens == 1024
    # the seats bound a step too: one seat of a 1024-token sequence never takes a 4096-token step
    LLMEngine(model, num_pages=pages, max_num_seqs=1, max_model_len=1024, max_num_batched_tokens=4096)


def test_prefill_activation_estimate_is_linear_and_matches_the_7b_measure():
    cfg = named_config("7b")
    per_token = memory.prefill_activation_bytes(cfg, torch.bfloat16, 1)
    assert per_token == 128 << 10  # session 12 measured about 132 KiB a token (bench_generate peaks)
    assert memory.prefill_activation_bytes(cfg, torch.bfloat16, 32768) == 32768 * per_token
    assert memory.prefill_activation_bytes(cfg, torch.float32, 10) == 20 * per_token


def test_parameter_count_matches_the_module():
    for cfg in (named_config("tiny"),):
        m = random_model(cfg)
        assert memory.parameter_count(cfg) == sum(p.numel() for p in m.parameters())
    assert memory.parameter_count(named_config("7b")) == 7_803_314_176  # 15.61 GB in bf16


def test_generate_cli_7b_on_cpu_exits_with_one_line():
    """The real CLI in a subprocess, run only where the estimate says 7b in fp32 cannot fit
    (otherwise it would allocate 31 GB): it must fail with a message, never be killed."""
    need = memory.weight_bytes(named_config("7b"), torch.float32)
    free = memory.cpu_available_bytes()
    if free is None or need <= free * memory.USABLE_FRACTION:
        pytest.skip(f"this machine could hold 7b in fp32 ({free} bytes free); the estimate would pass")
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "from sparsegen.cli import cli; cli()",
            "generate",
            "--random",
            "7b",
            "--device",
            "cpu",
            "--prompt-ids",
            "1",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode in (1, 2), (res.returncode, res.stderr[-2000:])
    assert "GiB" in res.stderr and "Traceback" not in res.stderr


# -- model options ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw,field",
    [({"device": "tpu"}, "device"), ({"device": ""}, "device"), ({"device": 3.5}, "device"),
     ({"dtype": torch.int32}, "dtype"), ({"dtype": "bf16"}, "dtype"), ({"force_dense": 1}, "force_dense"),
     ({"attn_impl": "cuda"}, "attn_impl"), ({"attn_impl": True}, "attn_impl"),
     ({"dummy_token_indices": "abc"}, "dummy_token_indices"), ({"dummy_token_indices": (1.5,)}, "dummy_token_indices"),
     ({"triton_gemv": 1}, "triton_gemv"), ({"gemv_o_proj": "yes"}, "gemv_o_proj"), ({"colour": "red"}, "colour")],
)  # fmt: skip
def test_bad_model_options_are_input_errors(kw, field):
    from sparsegen.models import ModelOptions

    with pytest.raises(InputError, match=field):
        random_model("tiny", **kw)
    if field != "colour":
        with pytest.raises(InputError, match=field):
            ModelOptions(**kw)


def test_model_options_and_keywords_build_the_same_model():
    from sparsegen.models import ModelOptions

    opts = ModelOptions(attn_impl="reference", force_dense=True)
    a, b = (
        random_model("tiny", opts, seed=3),
        random_model("tiny", seed=3, attn_impl="reference", force_dense=True),
    )
    assert a.options == b.options == opts
    assert all(blk.self_attn.prefill_impl == "reference" for blk in a.model.layers)
    ids = torch.tensor([1, 2, 3, 4])
    from sparsegen.models import ForwardBatch

    batch = ForwardBatch.whole_sequences([4])
    assert torch.equal(a(ids, batch), b(ids, batch))
    with pytest.raises(InputError, match="options must be a ModelOptions"):
        random_model("tiny", {"attn_impl": "reference"})


def test_triton_gemv_defaults_to_on_for_a_cuda_device_only():
    from sparsegen.models import ModelOptions
    from sparsegen.parallel.source import ModelSource

    assert ModelOptions().triton_gemv is None and not ModelOptions().gemv_on  # CPU
    assert ModelOptions(device="cuda").gemv_on and ModelOptions(device="cuda:1").gemv_on
    assert not ModelOptions(device="cuda", triton_gemv=False).gemv_on
    assert not ModelOptions(device="cuda", attn_impl="reference").gemv_on  # the oracle stays plain
    assert ModelOptions(triton_gemv=True).gemv_on
    # a default chosen on the CPU is not carried to another device: None stays None
    assert ModelOptions.of(ModelOptions(), device="cuda").gemv_on
    # built on a CPU by default: down_proj and lm_head in-major for cuBLAS, as before
    model = random_model("tiny", seed=0)
    assert not model.gemv and model.lm_head.weight.stride(0) == 1
    assert all(not b.mlp.gemv and b.mlp.down_proj.weight.stride(0) == 1 for b in model.model.layers)
    # tensor-parallel ranks keep cuBLAS (the tuned tiles are for whole layers)
    from sparsegen.parallel.sharding import TPShard

    rank = ModelSource(random="tiny").build(TPShard(0, 1), torch.device("cpu"))
    assert rank.options.triton_gemv is False


def test_set_triton_gemv_takes_a_bool_and_switches_every_layer():
    model = random_model("tiny", seed=0)
    with pytest.raises(InputError, match="bool"):
        model.set_triton_gemv(1)
    model.set_triton_gemv(True)
    assert model.options.triton_gemv and all(b.self_attn.gemv and b.mlp.gemv for b in model.model.layers)
    model.set_triton_gemv(False)
    assert not model.options.triton_gemv and not any(
        b.self_attn.gemv or b.mlp.gemv for b in model.model.layers
    )
    from sparsegen.models import ForwardBatch

    ids, batch = torch.tensor([3]), ForwardBatch.whole_sequences([1])
    model.set_triton_gemv(True)  # on a CPU: the plain path (or the GEMV where Triton's interpreter is on)
    on = model(ids, batch)
    model.set_triton_gemv(False)
    torch.testing.assert_close(on, model(ids, batch), rtol=1e-5, atol=1e-5)
    # o_proj: the output projection alone (ModelOptions.gemv_o_proj, on by default; GPU only)
    assert model.options.gemv_o_proj and all(b.self_attn.gemv_o for b in model.model.layers)
    with pytest.raises(InputError, match="o_proj"):
        model.set_triton_gemv(False, o_proj=0)
    model.set_triton_gemv(False, o_proj=False)
    assert not model.options.gemv_o_proj and not any(b.self_attn.gemv_o for b in model.model.layers)
    # on a CPU both take the plain path
    torch.testing.assert_close(on, model(ids, batch), rtol=1e-5, atol=1e-5)
    model.set_triton_gemv(True)  # o_proj=None keeps the current choice
    assert model.options.triton_gemv and not model.options.gemv_o_proj


# -- the prompt check's fast path -------------------------------------------------------------------
def _loop_check(prompt, vocab, where="prompt"):
    """check_prompt's per-token loop, as it was before its fast path (the oracle)."""
    for pos, tok in enumerate(prompt):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise InputError(f"{where} token {pos} is {tok!r} ({type(tok).__name__}), not an int token id")
        if not 0 <= tok < vocab:
            raise InputError(f"{where} token {tok!r} is not an id of the vocabulary 0..{vocab - 1}")
    return list(prompt)


class _Tok(int):
    """An int subclass (an IntEnum-like id): accepted by the loop, so by the fast path's fallback."""


FAST_PATH_PROMPTS = [
    [0],
    [VOCAB - 1],
    list(range(VOCAB)),
    (3, 4, 5),
    [1, 2, VOCAB],
    [VOCAB, 1, True],  # out of range before a bool: the range error, as the loop says
    [1, True, VOCAB],  # a bool before an out-of-range id
    [-1, 2.5],
    [2, 2.5, -1],
    [2**63],  # beyond int64
    [-(2**63) - 1],
    [2**70, 1],
    [1, _Tok(5), 2],
    [_Tok(VOCAB)],
    [1, "2"],
    [0] * 5000 + [True],  # a long prompt whose last token is bad
    [5] * 5000 + [-3],
]


@pytest.mark.parametrize("prompt", FAST_PATH_PROMPTS, ids=lambda p: repr(p)[:24])
def test_check_prompt_says_what_the_per_token_loop_says(prompt):
    from sparsegen.engine.checks import check_prompt

    try:
        want = _loop_check(prompt, VOCAB)
    except InputError as e:
        with pytest.raises(InputError) as err:
            check_prompt(prompt, VOCAB)
        assert str(err.value) == str(e)
    else:
        got = check_prompt(prompt, VOCAB)
        assert got == want and type(got) is list and got is not prompt
