"""GPU tier for the Triton prefill kernel: bf16/fp16 vs the reference, SDPA, the AOT cache."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

import sparsegen
from sparsegen import LayerSpec
from sparsegen.testing import PrefillProblem, assert_close_rows, sample_layer_spec

PREFILL_WINDOWS = (1, 17, 100, 333, 5000)  # windows shorter and longer than the sequences

pytestmark = pytest.mark.gpu


def _specs() -> list[LayerSpec]:
    """A few dozen distinct specs: Phi-3-like uniform layers and hybrid ones, GQA 1..8."""
    rng = random.Random(1234)
    out = [sparsegen.get_pattern("phi3small").layers[0], sparsegen.get_pattern("phi3small").layers[1]]
    for i in range(14):
        out.append(sample_layer_spec(rng, hybrid=bool(i % 2), ratios=(1, 2, 4, 8), windows=PREFILL_WINDOWS))
    return out


SPECS = _specs()


@pytest.fixture(scope="module", autouse=True)
def _precompiled():
    """Build every kernel this module needs in parallel, so the tests load them from disk."""
    from sparsegen.kernels.prefill import current_arch, precompile

    precompile(SPECS, (torch.bfloat16, torch.float16), arch=current_arch())


@pytest.fixture(autouse=True)
def _poison(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_POISON_OUTPUT", "1")


def _reference(p: PrefillProblem) -> torch.Tensor:
    t = p.tensors  # the oracle in float32 on the GPU (fast), compared in float64
    return sparsegen.reference.prefill(
        t["q"].float(), t["k"].float(), t["v"].float(), t["cu_seqlens_q"], t["cu_seqlens_k"], p.layer, p.scale
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("spec_id", range(len(SPECS)))
def test_fuzzed_shapes_match_reference(spec_id, dtype):
    layer = SPECS[spec_id]
    rng = random.Random(spec_id * 7 + (dtype == torch.float16))
    for case in range(10):
        batch = rng.randint(1, 3)
        k_lens = [
            rng.choice([1, 63, 64, 65, 129, 777, 1000, 2049, rng.randint(1, 3000)]) for _ in range(batch)
        ]
        q_lens = [n if rng.random() < 0.6 else rng.randint(1, n) for n in k_lens]
        scale = rng.choice([None, 0.05])
        p = PrefillProblem(layer, q_lens, k_lens, seed=case, dtype=dtype, device="cuda", scale=scale)
        out = sparsegen.prefill(*p.args(), impl="triton")
        assert_close_rows(out, _reference(p), context=p.repro())


@pytest.mark.parametrize("seq", [1000, 4096])
def test_dense_equals_causal_sdpa(seq):
    layer = sparsegen.get_pattern("phi3small").layers[1]
    p = PrefillProblem(layer, [seq], [seq], seed=seq, dtype=torch.bfloat16, device="cuda")
    out = sparsegen.prefill(*p.args(), impl="triton")
    q, k, v = (p.tensors[n].transpose(0, 1).unsqueeze(0).float() for n in "qkv")
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close_rows(out, ref[0].transpose(0, 1))


def test_get_kernel_object_and_memo():
    layer = SPECS[0]
    kernel = sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16)
    assert kernel.key.startswith(kernel.name) and "prefill_kernel" in kernel.source
    assert (kernel.path / "prefill_kernel.cubin").exists()
    assert sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16) is kernel
    p = PrefillProblem(layer, [300], [300], seed=0, dtype=torch.bfloat16, device="cuda")
    assert_close_rows(kernel(*p.args()), _reference(p))


def test_compile_then_disable_jit(tmp_path):
    env = {**os.environ, "SPARSEGEN_CACHE_DIR": str(tmp_path / "cache"), "SPARSEGEN_QUIET": "1"}
    cmd = [
        sys.executable,
        "-m",
        "sparsegen.cli",
        "compile",
        "--pattern",
        "phi3small",
        "--kind",
        "prefill",
        "--json",
    ]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    assert {r["status"] for r in json.loads(first.stdout)} == {"compiled"}
    script = (
        "import torch, sparsegen\n"
        "from sparsegen.testing import PrefillProblem, assert_close_rows\n"
        "layer = sparsegen.get_pattern('phi3small').layers[0]\n"
        "found = sparsegen.lookup_kernel(layer, 'prefill', dtype=torch.bfloat16)\n"
        "assert found.status == 'cached', found.status\n"
        "p = PrefillProblem(layer, [1500], [1500], seed=1, dtype=torch.bfloat16, device='cuda')\n"
        "assert_close_rows(sparsegen.prefill(*p.args()), p.reference(exact=False))\n"
        "print('ok')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "SPARSEGEN_DISABLE_JIT": "1"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-3000:]
