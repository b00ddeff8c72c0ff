"""torch.library registration of sparsegen::prefill and sparsegen::paged_decode (CPU tier)."""

from __future__ import annotations

import pytest
import torch

import sparsegen
import sparsegen.ops as sgops
from sparsegen import HeadSpec, LayerSpec
from sparsegen.testing import DecodeProblem, PrefillProblem, rel_err

LAYER = LayerSpec(
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    heads=(
        HeadSpec(block_size=16, local_blocks=2, vert_stride=3, vert_offset=1),
        HeadSpec(block_size=16, sliding_window=20),
        HeadSpec(dense=True),
        HeadSpec(block_size=32, local_blocks=1, vert_stride=2),
    ),
)


def _decode_args(dtype=torch.float32):
    p = DecodeProblem(LAYER, seq_lens=[1, 37, 70], page_size=16, seed=3, dtype=dtype)
    q, k, v, bt, sl, layer, scale = p.args()
    return p, (q, k, v, bt, sl, layer.to_json(), 0.1)


def _prefill_args(dtype=torch.float32):
    p = PrefillProblem(LAYER, q_lens=[5, 40], k_lens=[9, 40], seed=4, dtype=dtype)
    q, k, v, cq, ck, layer, scale = p.args()
    return p, (q, k, v, cq, ck, layer.to_json(), None)


def test_ops_are_registered():
    assert hasattr(torch.ops.sparsegen, "prefill")
    assert hasattr(torch.ops.sparsegen, "paged_decode")


def test_paged_decode_op_matches_reference():
    p, args = _decode_args()
    out = torch.ops.sparsegen.paged_decode(*args)
    ref = sparsegen.reference.paged_decode(*args[:5], LAYER, 0.1)
    assert rel_err(out, ref) < 1e-6


def test_prefill_op_matches_reference():
    p, args = _prefill_args()
    out = sgops.prefill_op(*args[:5], LAYER)
    assert rel_err(out, p.reference()) < 1e-5


def test_opcheck_paged_decode():
    _, args = _decode_args()
    torch.library.opcheck(torch.ops.sparsegen.paged_decode.default, args)


def test_opcheck_prefill():
    _, args = _prefill_args()
    torch.library.opcheck(torch.ops.sparsegen.prefill.default, args)


def test_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, args = _decode_args()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.sparsegen.paged_decode(*fake)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype


def test_torch_compile_fullgraph():
    p, args = _decode_args()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def step(q, k, v, bt, sl):
        return sgops.paged_decode_op(q * 1.0, k, v, bt, sl, LAYER, 0.1) + 0.0

    out = step(*args[:5])
    ref = sparsegen.reference.paged_decode(*args[:5], LAYER, 0.1)
    assert rel_err(out, ref) < 1e-6


def test_bad_layer_type():
    _, args = _decode_args()
    with pytest.raises(sparsegen.InputError):
        sgops.paged_decode_op(*args[:5], layer=42)


def test_public_functions_compile_fullgraph_and_equal_eager():
    """sg.prefill / sg.paged_decode route through the custom ops when traced: no graph break on
    host-side checks (they run at run time, inside the op)."""
    pp, pargs = _prefill_args()
    q, k, v, cq, ck = pargs[:5]
    dp, dargs = _decode_args()

    @torch.compile(backend="aot_eager", fullgraph=True)
    def both(q, k, v, cq, ck, dq, kc, vc, bt, sl):
        a = sparsegen.prefill(q * 1.0, k, v, cq, ck, LAYER)
        b = sparsegen.paged_decode(dq * 1.0, kc, vc, bt, sl, LAYER, 0.1)
        return a + 0.0, b + 0.0

    a, b = both(q, k, v, cq, ck, *dargs[:5])
    assert torch.equal(a, sparsegen.prefill(q, k, v, cq, ck, LAYER))
    assert torch.equal(b, sparsegen.paged_decode(*dargs[:5], LAYER, 0.1))


def test_public_functions_export_and_equal_eager():
    pp, pargs = _prefill_args()
    dp, dargs = _decode_args()

    class Attn(torch.nn.Module):
        def forward(self, q, k, v, cq, ck, dq, kc, vc, bt, sl):
            return (sparsegen.prefill(q, k, v, cq, ck, LAYER, 0.2),
                    sparsegen.paged_decode(dq, kc, vc, bt, sl, LAYER))  # fmt: skip

    inputs = (*pargs[:5], *dargs[:5])
    exported = torch.export.export(Attn(), inputs)
    targets = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert {"sparsegen.prefill.default", "sparsegen.paged_decode.default"} <= targets
    a, b = exported.module()(*inputs)
    assert torch.equal(a, sparsegen.prefill(*pargs[:5], LAYER, 0.2))
    assert torch.equal(b, sparsegen.paged_decode(*dargs[:5], LAYER))


def test_traced_call_still_validates_at_run_time():
    _, pargs = _prefill_args()
    q, k, v, cq, ck = pargs[:5]

    @torch.compile(backend="aot_eager", fullgraph=True)
    def f(q, k, v, cq, ck):
        return sparsegen.prefill(q, k, v, cq, ck, LAYER)

    bad = ck.clone()
    bad[-1] += 1  # cu_seqlens_k no longer ends at Tk
    with pytest.raises(sparsegen.InputError, match="cu_seqlens_k"):
        f(q, k, v, cq, bad)


def test_spec_json_is_the_spec_s_canonical_json():
    """spec_json reads the JSON made with the spec (no call under tracing); it is to_json()'s."""
    layer = sparsegen.get_pattern("phi3small").layers[0]
    assert sgops.spec_json(layer) == layer.to_json() == LayerSpec.from_json(layer.to_json()).to_json()
    assert "_json" not in repr(layer) and layer == LayerSpec.from_json(layer.to_json())


@pytest.mark.slow
def test_import_sparsegen_does_not_import_dynamo():
    import subprocess
    import sys

    code = "import sys, sparsegen, sparsegen.ops; print('torch._dynamo' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "False"
