"""CPU tier for the layer features of the Gluon (sm_90) prefill: soft-cap, learned sinks, sink
tokens and head_dim 48..256 (256 in its own tile shape). What it covers, what it refuses and why
(`covers`, `Family.features` / `head_dims`, `sparsegen show`), the render of each feature, the
launch arguments, and ahead-of-time sm_90 builds of the gpt-oss, Gemma-2, hd-256 dense causal and
sink-token layers: their PTX, their shared memory, and ptxas's report (no spills). The schedule
with sink tiles is checked by executing the rendered module (test_gluon_schedule_rendered.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import extras
from helpers.ptxas import ptx_report

import sparsegen
from sparsegen import HeadSpec, LayerSpec
from sparsegen.errors import ImplUnavailableError, InputError
from sparsegen.kernels import prefill_gluon_template as tpl

extras.require_gluon()

GPT_OSS = LayerSpec(64, 8, 64, (HeadSpec(block_size=64, sliding_window=128),) * 64, learned_sinks=True)
GEMMA2 = LayerSpec(16, 8, 256, (HeadSpec(block_size=64, sliding_window=4096),) * 16, logit_softcap=50.0,
                   scale=256**-0.5)  # fmt: skip
DENSE256 = LayerSpec(16, 8, 256, (HeadSpec(dense=True),) * 16)
STREAM = LayerSpec(8, 2, 128, (HeadSpec(block_size=64, sliding_window=256, sink_tokens=4),) * 8)
# a padded size (160 -> 256-wide tiles) with every feature
MIXED160 = LayerSpec(
    4, 2, 160, (HeadSpec(block_size=64, sliding_window=300, sink_tokens=20),) * 4, logit_softcap=20.0, learned_sinks=True
)  # fmt: skip
# two head patterns in 256-wide tiles spill registers (ptxas: 16-24 bytes): the tl kernel's
VERT_BESIDE160 = LayerSpec(
    4, 2, 160, (HeadSpec(block_size=64, sliding_window=300), HeadSpec(block_size=64, local_blocks=2, vert_stride=4)) * 2
)  # fmt: skip
# four head patterns in 256-wide tiles spill registers (ptxas: 24 bytes): the tl kernel's
HYBRID256 = LayerSpec(
    4, 2, 256,
    (HeadSpec(block_size=64, sliding_window=300), HeadSpec(block_size=64, local_blocks=2, vert_stride=4),
     HeadSpec(dense=True), HeadSpec(block_size=64, local_blocks=1)),
)  # fmt: skip


def test_the_target_layers_are_covered_and_picked_on_sm90(monkeypatch):
    from sparsegen.kernels.base import default_variant

    monkeypatch.delenv("SPARSEGEN_PREFILL_TL", raising=False)
    for layer in (GPT_OSS, GEMMA2, DENSE256, STREAM, MIXED160):
        assert tpl.covers(layer, "bf16") is None and tpl.covers(layer, "fp16") is None, layer
    for layer in (GEMMA2, DENSE256, STREAM, MIXED160):
        assert default_variant("prefill", "sm_90", layer, "bf16") == "gluon"
    # gpt-oss's window-128 GQA-8 layer: covered, but the tl kernel's packed query heads are faster
    assert default_variant("prefill", "sm_90", GPT_OSS, "bf16") == "tl"


def test_family_declares_what_the_template_covers():
    from sparsegen.kernels.families.prefill_gluon import GluonPrefill

    fam = GluonPrefill()
    assert fam.features == {"sink_tokens", "logit_softcap", "learned_sinks"}
    assert fam.head_dims == tuple(range(48, 257, 16)) == tpl.HEAD_DIMS
    assert 32 not in fam.head_dims  # head_dim 32 goes to the tl kernel


@pytest.mark.parametrize(
    "layer, why, err",
    [
        (LayerSpec(2, 1, 32, (HeadSpec(sliding_window=64),) * 2), "head_dim 32", "take head_dim .*, not 32"),
        (LayerSpec(2, 1, 128, (HeadSpec(block_size=64, local_blocks=2, vert_stride=4, sink_tokens=4),) * 2),
         "head 0: sink tokens on a vertical-stride head", "head 0: sink tokens on a vertical-stride head"),
        (HYBRID256, "4 distinct head patterns at head_dim 256", "4 distinct head patterns at head_dim 256"),
        (VERT_BESIDE160, "2 distinct head patterns at head_dim 160", "2 distinct head patterns at head_dim 160"),
    ],
)  # fmt: skip
def test_what_goes_to_tl_says_why(layer, why, err):
    from sparsegen.commands.show import _features
    from sparsegen.kernels.base import default_variant

    assert why in tpl.covers(layer, "bf16")
    assert default_variant("prefill", "sm_90", layer, "bf16") == "tl"
    assert _features(layer)["prefill_sm90"].startswith(f"tl (Gluon does not cover {why}")
    with pytest.raises(ImplUnavailableError, match=err):
        sparsegen.lookup_kernel(layer, "prefill", dtype=torch.bfloat16, arch="sm_90", variant="gluon")


def test_show_names_the_padded_tile():
    from sparsegen.commands.show import _features

    assert _features(MIXED160)["prefill_sm90"] == "gluon (head_dim 160 in 256-wide tiles)"
    assert _features(GEMMA2)["prefill_sm90"] == "gluon"


def test_hd256_config_fits_shared_memory_and_refuses_what_does_not():
    cfg = tpl.config(GEMMA2)
    assert (cfg["block_n"], cfg["stages"], cfg["q_smem"], cfg["vpair"]) == (64, 2, True, False)
    assert tpl.smem_bytes(GEMMA2, cfg) == 128 * 256 * 2 + 2 * 2 * 64 * 256 * 2 <= tpl.SMEM_LIMIT
    with pytest.raises(InputError, match=r"shared memory at head_dim 256 \(block_n 128, stages 3"):
        tpl.config(GEMMA2, block_n=128, stages=3)
    assert tpl.config(tpl_phi := sparsegen.get_pattern("phi3small").layers[0], q_smem=True)  # 224 KB: fits
    assert tpl.smem_bytes(tpl_phi, tpl.config(tpl_phi, q_smem=True)) <= tpl.SMEM_LIMIT


def test_features_render_only_where_asked():
    plain = tpl.render_source(LayerSpec(16, 8, 256, GEMMA2.heads), "bf16")
    capped = tpl.render_source(GEMMA2, "bf16")
    for word in ("tanh", "SOFTCAP_LOG2", "Sinks", "sk =", "LOG2E"):
        assert word not in plain, word
    assert "SOFTCAP_LOG2 = gl.constexpr(50 / 1 * 1.4426950408889634)" in capped
    assert "s = _tanh(s * (qk_scale / SOFTCAP_LOG2))\n" in capped
    # the cap comes before the mask; C2 = c * log2(e) scales tanh in the max and in the exponent
    body = capped[capped.index("def _softmax(") :]
    assert (
        body.index("_tanh(")
        < body.index("gl.where(_visible_0")
        < body.index("m_new = gl.maximum(m_i, gl.max(s, 1) * SOFTCAP_LOG2)")
    )
    assert "p = gl.exp2(s * SOFTCAP_LOG2 - m_ref[:, None])" in body and "s * qk_scale - m_ref" not in body
    sinks = tpl.render_source(GPT_OSS, "bf16")
    assert "def prefill_kernel(Q, O, Sinks, k_desc," in sinks
    assert "l_i = l_i + gl.exp2(gl.load(Sinks + h) * LOG2E - m_i)" in sinks
    assert "tanh" not in sinks and "sk =" not in sinks
    stream = tpl.render_source(STREAM, "bf16")
    assert "seen = seen | (cols < 4)  # sink tokens" in stream and "sk = gl.minimum(a, 4)" in stream
    assert "Sinks" not in stream and "tanh" not in stream


def test_sink_paths_are_split_by_their_sink_count():
    heads = (HeadSpec(sliding_window=64, sink_tokens=4), HeadSpec(sliding_window=64, sink_tokens=8),
             HeadSpec(sliding_window=64), HeadSpec(sliding_window=64, sink_tokens=4))  # fmt: skip
    found = tpl.paths(LayerSpec(4, 2, 64, heads))
    assert [(p["sink"], p["ranges"]) for p in found] == [(4, [[0, 1], [3, 4]]), (8, [[1, 2]]), (0, [[2, 3]])]


class _Entry:
    """Stands in for the loaded CompiledKernel: `entry[grid]` is what Launch calls."""

    def __getitem__(self, grid):
        return ("launcher", grid)


def _kernel(layer: LayerSpec):
    from sparsegen.kernels.base import KernelRequest
    from sparsegen.kernels.prefill_gluon import GluonPrefillKernel

    request = KernelRequest.make("prefill", layer, dtype=torch.bfloat16, arch="sm_90", variant="gluon")
    return GluonPrefillKernel(request, "key", "name", Path("."), "", tpl.config(layer), _Entry())


def test_learned_sinks_launch_arguments():
    from sparsegen.kernels.families.prefill_gluon import arg_names, signature

    n = 200
    q = torch.randn(n, 64, 64, dtype=torch.bfloat16)
    k = torch.randn(n, 8, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, n], dtype=torch.int32)
    sinks = torch.randn(64)
    kernel = _kernel(GPT_OSS)
    launch = kernel.prepare(q, k, k, cu, cu, 0.125, sinks=sinks)
    args = dict(zip(arg_names(GPT_OSS), launch.args, strict=True))
    assert args["Sinks"] is sinks and args["O"] is launch.out
    assert list(signature(GPT_OSS, "bf16", kernel.config))[:4] == ["Q", "O", "Sinks", "k_desc"]
    assert signature(GPT_OSS, "bf16", kernel.config)["Sinks"] == "*fp32"
    assert "Sinks" not in signature(DENSE256, "bf16", tpl.config(DENSE256))
    with pytest.raises(InputError, match="sinks= must be given exactly"):
        kernel.prepare(q, k, k, cu, cu, 0.125)
    with pytest.raises(InputError, match="sinks= must be given exactly"):
        _kernel(DENSE256).prepare(q[..., :0], k, k, cu, cu, 0.1, sinks=sinks)


def test_hd256_launch_arguments_use_the_2d_view():
    from sparsegen.kernels.prefill_gluon import ARG_NAMES

    n = 130
    q = torch.randn(n, 16, 256, dtype=torch.bfloat16)
    k = torch.randn(n, 8, 256, dtype=torch.bfloat16)
    cu = torch.tensor([0, n], dtype=torch.int32)
    launch = _kernel(DENSE256).prepare(q, k, k, cu, cu, 0.0625)
    args = dict(zip(ARG_NAMES, launch.args, strict=True))
    assert list(args["k_desc"].block_shape) == [64, 256] and list(args["k_desc"].shape) == [n, 8 * 256]
    assert launch.fn == ("launcher", (16 * 2, 1, 1))


def _built(layer: LayerSpec, dtype=torch.bfloat16, variant=None):
    found = sparsegen.lookup_kernel(layer, "prefill", dtype=dtype, arch="sm_90", variant=variant)
    kernel = found.kernel
    assert kernel.request.variant == "gluon", kernel.name
    meta = json.loads((kernel.path / "prefill_kernel.json").read_text())
    return kernel, kernel.ptx, meta


def _no_spills(ptx: str) -> None:
    report = ptx_report(ptx)
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    assert re.search(r"Used 168 registers", report), report  # the kernel's .maxnreg (setmaxnreg splits it)


def _wgmma(ptx: str, n: int, dtype: str = "bf16") -> bool:
    return bool(re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{n}k16\.f32\.{dtype}\.{dtype}", ptx))


@pytest.mark.slow
def test_aot_gpt_oss_layer():
    kernel, ptx, meta = _built(GPT_OSS, variant="gluon")  # named: the default takes tl's packed heads
    assert kernel.name == "prefill_gluon_bf16_hd64_h64kv8_bs64_w128_lsink"
    assert _wgmma(ptx, 128) and _wgmma(ptx, 64)  # S = Q K^T over 128 keys, O over 64 columns
    assert "tanh.approx" not in ptx and meta["shared"] <= tpl.SMEM_LIMIT
    _no_spills(ptx)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_aot_gemma2_layer(dtype):
    kernel, ptx, meta = _built(GEMMA2, dtype)
    kind = "bf16" if dtype == torch.bfloat16 else "f16"
    assert kernel.name == f"prefill_gluon_{kernel.request.dtype}_hd256_h16kv8_bs64_w4096_cap50"
    assert _wgmma(ptx, 64, kind) and _wgmma(ptx, 256, kind)  # S over 64 keys, O over 256 columns
    assert "tanh.approx.f32" in ptx
    assert meta["shared"] <= tpl.SMEM_LIMIT, meta["shared"]
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx)
    _no_spills(ptx)


@pytest.mark.slow
def test_aot_hd256_dense_causal():
    kernel, ptx, meta = _built(DENSE256)
    assert _wgmma(ptx, 256) and "tanh" not in ptx and meta["shared"] <= tpl.SMEM_LIMIT
    assert "cp.async.bulk.tensor.2d" in ptx
    _no_spills(ptx)


@pytest.mark.slow
def test_aot_sink_tokens_with_a_window():
    _kernel, ptx, meta = _built(STREAM)
    assert meta["shared"] <= tpl.SMEM_LIMIT
    _no_spills(ptx)


@pytest.mark.slow
def test_aot_padded_hd160_every_feature():
    kernel, ptx, meta = _built(MIXED160, torch.float16)
    assert "cp.async.bulk.tensor.3d" in ptx and "tanh.approx.f32" in ptx
    assert [m["block_size"] for m in meta["tensordesc_meta"]] == [
        [64, 1, 64]
    ] * 2  # 256-wide box in 64-col messages
    assert meta["shared"] <= tpl.SMEM_LIMIT
    _no_spills(ptx)
