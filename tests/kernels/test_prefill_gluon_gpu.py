"""GPU tier for the Hopper Gluon prefill (`pytest -m gpu` on an sm_90 GPU): fuzzed specs and shapes
against the reference with NaN-poisoned outputs, agreement with the tl kernel, and the
metamorphic checks (the last row equals decode; a prefix plus a chunk equals the whole).
head_dim 96 (128-wide tiles, 3-D TMA descriptors with zero fill) has its own specs and tests, all
with "hd96" in their names: `pytest -m gpu tests/kernels/test_prefill_gluon_gpu.py -k hd96`."""

from __future__ import annotations

import random

import pytest
import torch

import sparsegen
from sparsegen import LayerSpec
from sparsegen.errors import InputError
from sparsegen.kernels import prefill_gluon_template as tpl
from sparsegen.testing import DecodeProblem, PrefillProblem, assert_close_rows, rel_err, sample_layer_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
        reason="the Gluon prefill kernel runs on sm_90 (Hopper) only",
    ),
]
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
WINDOWS = (1, 17, 100, 333, 5000)  # shorter and longer than the sequences


def _specs() -> list:
    rng = random.Random(90)
    phi = sparsegen.get_pattern("phi3small")
    out = [phi.layers[0], phi.layers[1], sparsegen.get_pattern("sliding-window").layers[0]]
    while len(out) < 14:
        layer = sample_layer_spec(
            rng, hybrid=bool(len(out) % 2), head_dims=(64, 128), ratios=(1, 2, 4, 8), windows=WINDOWS
        )
        if tpl.covers(layer, "bf16") is None:
            out.append(layer)
    return out


SPECS = _specs()


def _at_96(layer):
    return LayerSpec(
        num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=96, heads=layer.heads
    )


def _specs96() -> list:
    """phi3small's sparse (vpair tiles) and dense layers and the window preset at head_dim 96, then
    fuzzed specs (hybrid and Phi-3 style, GQA 1-8, windows shorter and longer than the sequences)."""
    rng = random.Random(96)
    out = [_at_96(SPECS[0]), _at_96(SPECS[1]), _at_96(SPECS[2])]
    while len(out) < 8:
        layer = sample_layer_spec(rng, hybrid=bool(len(out) % 2), head_dims=(96,), ratios=(1, 2, 4, 8),
                                  windows=WINDOWS)  # fmt: skip
        if tpl.covers(layer, "bf16") is None:
            out.append(layer)
    return out


SPECS96 = _specs96()


@pytest.fixture(scope="module", autouse=True)
def _precompiled(request):
    """Build the rule's Gluon kernels (the default variant on sm_90) and the tl twins of every spec
    the selected tests use (SPECS96 for the hd96 tests, SPECS for the rest) side by side (Triton
    builds in worker processes), so the tests load them from disk."""
    from sparsegen.kernels.prefill import precompile

    ids = [item.nodeid for item in request.session.items if item.path == request.path]
    specs = (SPECS if any("hd96" not in i for i in ids) else []) + (
        SPECS96 if any("hd96" in i for i in ids) else []
    )
    precompile(specs, (torch.bfloat16, torch.float16), arch="sm_90")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARSEGEN_PREFILL_TL", "1")
        precompile(specs, (torch.bfloat16, torch.float16), arch="sm_90")


def test_impl_triton_picks_gluon_on_sm90():
    from sparsegen.kernels.prefill_gluon import GluonPrefillKernel

    layer = SPECS[0]
    assert isinstance(sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16), GluonPrefillKernel)
    p = PrefillProblem(layer, [999, 2000], [1500, 2000], seed=2, dtype=torch.bfloat16, device="cuda")
    out = sparsegen.prefill(*p.args(), impl="triton")
    assert_close_rows(out, _reference(p))


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")


# Launch shapes besides the rule's: one program per work item, a persistent grid of 3 programs
# (many items per program: the ring's phases run on across items), and ping-pong consumers.
CONFIGS = (
    {},
    {"persistent": False},
    {"persistent": True, "programs": 3},
    {"pingpong": True},
    {"pingpong": True, "persistent": True, "programs": 5},
    {"kv_major": True},
    {"kv_major": True, "persistent": True, "programs": 7},
    {"block_n": 64, "stages": 3, "vpair": False},  # session 4's first rule for vertical layers
    {"block_n": 128, "stages": 2, "vpair": True},
    {"block_n": 128, "vpair": False},  # refused for 64-token vertical blocks
)
TL = {"variant": "tl"}  # the tl twin (without a variant, sm_90 gets the Gluon kernel)


def _gluon(layer, dtype, **overrides):
    from sparsegen.kernels.prefill_gluon import get_gluon_prefill_kernel

    return get_gluon_prefill_kernel(layer, dtype=dtype, **overrides)


def _reference(p: PrefillProblem) -> torch.Tensor:
    return p.reference(exact=False)  # float32 math on the GPU, compared in float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec_id", range(len(SPECS)))
def test_fuzzed_against_reference_and_tl(spec_id, dtype):
    _check_fuzzed(SPECS[spec_id], dtype, random.Random(spec_id * 11 + (dtype == torch.float16)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec_id", range(len(SPECS96)))
def test_hd96_fuzzed_against_reference_and_tl(spec_id, dtype):
    from sparsegen.kernels.prefill_gluon import GluonPrefillKernel

    layer = SPECS96[spec_id]
    assert isinstance(sparsegen.get_kernel(layer, "prefill", dtype=dtype), GluonPrefillKernel)  # the default
    _check_fuzzed(layer, dtype, random.Random(960 + spec_id * 11 + (dtype == torch.float16)))


def _check_fuzzed(layer, dtype, rng: random.Random) -> None:
    """8 varlen batches (odd lengths, prefixes, scales) against the reference and the tl kernel."""
    from sparsegen.kernels.prefill import get_prefill_kernel

    kernel, tl_kernel = _gluon(layer, dtype), get_prefill_kernel(layer, dtype=dtype, **TL)
    for case in range(8):
        batch = rng.randint(1, 3)
        k_lens = [
            rng.choice([1, 63, 64, 65, 127, 129, 777, 1000, 2049, rng.randint(1, 3000)]) for _ in range(batch)
        ]
        q_lens = [n if rng.random() < 0.5 else rng.randint(1, n) for n in k_lens]  # prefixes
        p = PrefillProblem(
            layer,
            q_lens,
            k_lens,
            seed=case,
            dtype=dtype,
            device="cuda",
            scale=rng.choice([None, 0.05, 1.0 / layer.head_dim]),
        )
        out = kernel(*p.args())
        assert_close_rows(out, _reference(p), context=p.repro())
        err_tl = rel_err(out, tl_kernel(*p.args()))
        assert err_tl < 2e-2, f"rel err vs the tl kernel {err_tl:.3g}: {p.repro()}"


@pytest.mark.parametrize("config", CONFIGS[1:], ids=lambda c: "_".join(f"{k}{int(v)}" for k, v in c.items()))
@pytest.mark.parametrize("which", [0, 1, 2])
def test_launch_shapes_agree(which, config):
    """Other launch shapes compute the same function (persistent grids run many items per program)."""
    layer = SPECS[which]
    vertical = any(h.vert_stride and not h.dense for h in layer.heads)
    if vertical and config.get("block_n", 128) > 64 and config.get("vpair") is False:
        with pytest.raises(InputError, match="does not divide"):  # 64-token vertical blocks
            _gluon(layer, torch.bfloat16, **config)
        return
    kernel = _gluon(layer, torch.bfloat16, **config)
    for case, (q_lens, k_lens) in enumerate([([700, 1, 3000], [1000, 64, 3000]), ([129, 4097], [129, 5000])]):
        p = PrefillProblem(layer, q_lens, k_lens, seed=case, dtype=torch.bfloat16, device="cuda")
        assert_close_rows(kernel(*p.args()), _reference(p), context=f"with {config}: {p.repro()}")


HD96_CONFIGS = (
    {"persistent": True, "programs": 3},
    {"pingpong": True},
    {"q_smem": True},  # Q through shared memory: the masked load feeds allocate_shared_memory
    {"block_n": 64, "stages": 3, "vpair": False},
    {"block_n": 128, "stages": 2, "vpair": True},
)


@pytest.mark.parametrize("config", HD96_CONFIGS, ids=lambda c: "_".join(f"{k}{int(v)}" for k, v in c.items()))
@pytest.mark.parametrize("which", [0, 1])
def test_hd96_launch_shapes_agree(which, config):
    layer = SPECS96[which]
    kernel = _gluon(layer, torch.bfloat16, **config)
    for case, (q_lens, k_lens) in enumerate([([700, 1, 3000], [1000, 64, 3000]), ([129, 4097], [129, 5000])]):
        p = PrefillProblem(layer, q_lens, k_lens, seed=case, dtype=torch.bfloat16, device="cuda")
        assert_close_rows(kernel(*p.args()), _reference(p), context=f"with {config}: {p.repro()}")


@pytest.mark.parametrize("which", [0, 1, 2])
def test_last_row_equals_decode(which):
    _check_last_row_equals_decode(SPECS[which])


@pytest.mark.parametrize("which", [0, 1, 2])
def test_hd96_last_row_equals_decode(which):
    _check_last_row_equals_decode(SPECS96[which])


def _check_last_row_equals_decode(layer) -> None:
    n, page_size = 3001, 16
    p = DecodeProblem(layer, [n], page_size, seed=7, dtype=torch.bfloat16, device="cuda")
    q, kc, vc, bt, sl, _, scale = p.args()
    q_full, k, v, cu, _ = p.as_prefill(0)
    last = _gluon(layer, torch.bfloat16)(q_full, k, v, cu, cu, layer, scale)[-1]
    dec = sparsegen.paged_decode(q, kc, vc, bt, sl, layer, scale, impl="cuda")[0]
    assert rel_err(last, dec) < 1e-2


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_prefix_plus_chunk_equals_whole(which, dtype):
    _check_prefix_plus_chunk(SPECS[which], dtype)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_hd96_prefix_plus_chunk_equals_whole(which, dtype):
    _check_prefix_plus_chunk(SPECS96[which], dtype)


def _check_prefix_plus_chunk(layer, dtype) -> None:
    kernel = _gluon(layer, dtype)
    n, chunk = 5000, 1234
    p = PrefillProblem(layer, [n], [n], seed=11, dtype=dtype, device="cuda")
    q, k, v, cu, _, _, _ = p.args()
    whole = kernel(q, k, v, cu, cu)
    cu_q = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    part = kernel(q[-chunk:].contiguous(), k, v, cu_q, cu)
    assert rel_err(part, whole[-chunk:]) < TOL[dtype]


def test_long_sequence_phi3small():
    layer = SPECS[0]
    p = PrefillProblem(layer, [20000], [20000], seed=3, dtype=torch.bfloat16, device="cuda")
    assert_close_rows(_gluon(layer, torch.bfloat16)(*p.args()), _reference(p))


@pytest.mark.parametrize("specs", [SPECS, SPECS96], ids=["hd128", "hd96"])
def test_dense_equals_causal_sdpa(specs):
    layer = specs[1]
    p = PrefillProblem(layer, [4096], [4096], seed=4, dtype=torch.bfloat16, device="cuda")
    out = _gluon(layer, torch.bfloat16)(*p.args())
    q, k, v = (p.tensors[n].transpose(0, 1).unsqueeze(0).float() for n in "qkv")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close_rows(out, ref[0].transpose(0, 1))


@pytest.mark.parametrize("specs", [SPECS, SPECS96], ids=["hd128", "hd96"])
def test_strided_kv_views_are_read_correctly(specs):
    """K and V as views into a fused qkv buffer (head stride != head_dim), read in place by TMA."""
    layer = specs[0]
    n, h, hkv, d = 777, layer.num_heads, layer.num_kv_heads, layer.head_dim
    qkv = torch.randn(n, hkv, h // hkv + 2, d, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, :, : h // hkv].reshape(n, h, d)
    k, v = qkv[:, :, -2], qkv[:, :, -1]  # [n, Hkv, D], stride(1) = (h/hkv + 2) * d
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out = _gluon(layer, torch.bfloat16)(q, k, v, cu, cu)
    ref = sparsegen.reference.prefill(q.float(), k.float(), v.float(), cu, cu, layer)
    assert_close_rows(out, ref)


def test_hd96_head_major_kv_is_read_correctly():
    """K and V as [Hkv, Tk, D] buffers seen as [Tk, Hkv, D] (tokens not outermost): the 3-D
    descriptor takes a row-major copy."""
    layer = SPECS96[1]
    n, hkv, d = 1000, layer.num_kv_heads, 96
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(n, layer.num_heads, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(0, 1)
        for _ in range(2)
    )
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    out = _gluon(layer, torch.bfloat16)(q, k, v, cu, cu)
    ref = sparsegen.reference.prefill(q.float(), k.float(), v.float(), cu, cu, layer)
    assert_close_rows(out, ref)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.parametrize("poison", ["neighbour_head", "row_gap"])
def test_hd96_neighbouring_data_never_reaches_a_head(which, poison):
    """A 128-wide read of a 96-wide head would take 32 columns of whatever follows it in memory.
    neighbour_head: contiguous k, v [Tk, Hkv, 96] with every odd KV head all Inf (k) and NaN (v), so
    each even head's row is followed by poison. row_gap: k, v are views into [Tk, Hkv, 128] buffers whose columns 96..127
    are Inf/NaN. Every query head that reads a clean KV head must equal the reference on clean data."""
    layer = SPECS96[which]
    hkv, group, d = layer.num_kv_heads, layer.group_size, 96
    assert hkv >= 2, "the test needs a neighbouring KV head"
    n_k, n_q = 2049, 1500
    p = PrefillProblem(layer, [n_q, 300], [n_k, 301], seed=9, dtype=torch.bfloat16, device="cuda")
    q, k, v, cu_q, cu_k, _, _ = p.args()
    ref = p.reference(exact=False)  # clean data
    if poison == "neighbour_head":
        bad = list(range(1, hkv, 2))  # head g's 96 columns are followed by head g + 1's in memory
        k, v = k.clone(), v.clone()
        k[:, bad] = float("inf")
        v[:, bad] = float("nan")
    else:
        bad = []
        k_buf = torch.full((k.shape[0], hkv, 128), float("inf"), device="cuda", dtype=k.dtype)
        v_buf = torch.full((v.shape[0], hkv, 128), float("nan"), device="cuda", dtype=v.dtype)
        k_buf[..., :d], v_buf[..., :d] = k, v
        k, v = k_buf[..., :d], v_buf[..., :d]  # stride(1) = 128: the gap after each row is poison
    out = _gluon(layer, torch.bfloat16)(q, k, v, cu_q, cu_k)
    clean = [h for h in range(layer.num_heads) if h // group not in bad]
    assert_close_rows(out[:, clean], ref[:, clean])


@pytest.mark.parametrize("which", [0, 1])
def test_hd96_equals_hd128_on_zero_padded_inputs(which):
    """The padded kernel computes what the head_dim-128 kernel (measured on the H200) computes on
    q, k, v zero-padded to 128 columns, with the same scale: the same tiles, the same wgmmas on the
    same shared-memory bytes. Held far tighter than the reference tolerance (a rounding flip of an
    output here and there is allowed)."""
    layer = SPECS96[which]
    wide = LayerSpec(
        num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_dim=128, heads=layer.heads
    )
    p = PrefillProblem(
        layer, [1000, 77, 3000], [1500, 77, 3000], seed=12, dtype=torch.bfloat16, device="cuda"
    )
    q, k, v, cu_q, cu_k, _, _ = p.args()
    pad = [torch.nn.functional.pad(t, (0, 32)) for t in (q, k, v)]  # [T, H, 128], columns 96.. zero
    out = _gluon(layer, torch.bfloat16)(q, k, v, cu_q, cu_k, scale=0.1)
    out_wide = _gluon(wide, torch.bfloat16)(*pad, cu_q, cu_k, scale=0.1)
    assert out_wide[..., 96:].abs().max() == 0
    diff = (out.float() - out_wide[..., :96].float()).abs().max().item()
    assert rel_err(out, out_wide[..., :96]) < 1e-3, f"max abs diff {diff:.3g}"
