"""The model's own kernels under the one lifecycle (GEMV, few-row GEMM, rotary + KV write, GeGeLU,
add + LayerNorm): each builds ahead of time for sm_90 on a CPU, is found in the disk cache by a
second lookup, is refused under SPARSEGEN_DISABLE_JIT when missing, and is rebuilt when its
entry is corrupt; a Triton launch's request carries exactly what Triton's JIT would have
compiled for it; `compile --model-kernels` builds them; `sparsegen.models` imports no toolchain.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from sparsegen.errors import JitDisabledError
from sparsegen.kernels import base
from sparsegen.kernels.fused import add_norm, gegelu, rotary
from sparsegen.kernels.launch_target import aot_target
from sparsegen.kernels.linear import gemm_rows, gemv
from sparsegen.kernels.linear.gemm_rows_tiles import Tile
from sparsegen.kernels.linear.rope_write import RopeWrite

ARCH = "sm_90"
TARGET = aot_target(ARCH)
MODELS = Path(__file__).resolve().parents[2] / "sparsegen" / "models"


def _meta(*shape, dtype=torch.float16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _small_requests() -> dict[str, base.KernelRequest]:
    """One small request of every model kernel kind, as their launches make them."""
    x, w, b, ln = _meta(1, 64), _meta(96, 64), _meta(96), _meta(64)
    cache = _meta(3, 2, 8, 16).transpose(1, 2)  # [pages, page_size, Hkv, D], head-major
    cos = _meta(1, 16, dtype=torch.float32)
    rope = RopeWrite(cos, cos, 1, cache, cache, _meta(1, dtype=torch.int64))
    qkv, slots, cos5 = _meta(5, 2, 3, 16), _meta(5, dtype=torch.int64), _meta(5, 16, dtype=torch.float32)
    return {
        "gemv": gemv.request(x, w, b, target=TARGET, arch=ARCH, norm=(x, ln, ln, 1e-5), rope=rope),
        "gemm_rows": base.KernelRequest.of(
            "gemm_rows", gemm_rows.Build(512, 1024, "fp16", Tile(128, 128, 2, 3)), dtype="fp16", arch=ARCH
        ),
        "rotary_kv_write": rotary.request(qkv, cos5, cos5, (cache, cache), slots, target=TARGET, arch=ARCH),
        "gegelu": gegelu.request(_meta(5, 128), 20.0, arch=ARCH),
        "add_norm": add_norm.request(
            _meta(5, 64), _meta(5, 64), ln, ln, 1e-5, pdl=True, trigger=True, target=TARGET, arch=ARCH
        ),  # fmt: skip
    }


def test_every_model_kernel_builds_ahead_of_time_then_is_cached(fresh_cache):
    requests = _small_requests()
    assert set(requests) == set(base.MODEL_KINDS)
    first = {kind: base.lookup(req) for kind, req in requests.items()}
    for kind, found in first.items():
        assert found.status == "compiled", kind
        assert found.kernel.name.startswith(kind) and found.kernel.arch == ARCH
        cubin = next(found.kernel.path.glob("*.cubin"))
        assert cubin.read_bytes()[:4] == b"\x7fELF", kind
    assert {kind: base.lookup(req).status for kind, req in requests.items()} == dict.fromkeys(
        requests, "memory"
    )
    base.forget()  # a new process: only the disk cache is left
    again = {kind: base.lookup(req) for kind, req in requests.items()}
    assert {k: f.status for k, f in again.items()} == dict.fromkeys(requests, "cached")
    assert {k: f.kernel.key for k, f in again.items()} == {k: f.kernel.key for k, f in first.items()}


def test_a_missing_model_kernel_is_refused_under_disable_jit(fresh_cache, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_DISABLE_JIT", "1")
    for kind, req in _small_requests().items():
        name = base.key_of(req).name
        with pytest.raises(JitDisabledError, match=name):
            base.lookup(req)
        assert name.startswith(kind)


@pytest.mark.parametrize("kind", ["gemv", "gemm_rows"])
def test_a_corrupt_model_kernel_entry_is_rebuilt(fresh_cache, kind):
    req = _small_requests()[kind]
    first = base.lookup(req)
    cubin = next(first.kernel.path.glob("*.cubin"))
    cubin.chmod(0o600)
    cubin.write_bytes(cubin.read_bytes()[:100])  # truncated: its hash no longer matches
    base.forget()
    rebuilt = base.lookup(req)
    assert rebuilt.status == "compiled" and rebuilt.kernel.key == first.kernel.key
    base.forget()
    assert base.lookup(req).status == "cached"


def _jit_inputs(fam, args, constexprs, options, folder: Path):
    """What Triton's JIT derives from the launch `fn[grid](*args, **constexprs, **options)` of the
    family's template kernel: its binder and `_pack_args`, on CPU tensors (nothing is launched)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import create_function_from_signature

    from sparsegen.jit import render as jit_render
    from sparsegen.jit.triton_compile import import_module

    path = folder / "kernel.py"
    path.write_text(jit_render.render(fam.template))
    fn = getattr(import_module(path, f"sg_test_{fam.kind}"), fam.fn_name)
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = {**dict(zip(fam.constexpr_names, constexprs)), **dict(options), "debug": False,
              "instrumentation_mode": knobs.compilation.instrumentation_mode}  # fmt: skip
    bound, spec, opts = binder(*args, **kwargs)
    parsed, signature, consts, attrs = fn._pack_args(backend, kwargs, bound, spec, opts)
    return signature, consts, attrs, parsed, backend


def _launches():
    """Each Triton family's launch on real CPU tensors: aligned and unaligned pointers, ints
    divisible by 16, ints equal to 1, floats."""
    x = torch.randn(2, 65, dtype=torch.float16)[:, 1:]  # rows not 16-byte aligned
    w, b, ln = torch.randn(96, 64, dtype=torch.float16), torch.randn(96, dtype=torch.float16), torch.ones(64)
    cache = torch.zeros(3, 2, 8, 16, dtype=torch.float16).transpose(1, 2)
    cos = torch.ones(1, 16)
    rope = RopeWrite(cos, cos, 1, cache, cache, torch.zeros(1, dtype=torch.int64))
    qkv = torch.randn(5, 2, 3, 16, dtype=torch.float16)
    cos5 = torch.ones(5, 16)
    return [
        (
            gemv,
            gemv._plan(
                x[0],
                w,
                b,
                None,
                (x[1], ln.half(), ln.half(), 1e-5),
                rope,
                None,
                None,
                4,
                None,
                None,
                None,
                TARGET,
            )[2],
        ),  # fmt: skip
        (gemv, gemv._plan(x[0], w, None, 3.0, None, None, None, None, 4, None, None, None, TARGET)[2]),
        (rotary, rotary._plan(qkv, cos5, cos5, (cache, cache), torch.arange(5), TARGET)[3]),
        (rotary, rotary._plan(qkv, cos5, cos5, None, None, TARGET)[3]),
        (gegelu, gegelu._plan(torch.randn(3, 34, dtype=torch.float16), 20.0)[1]),
        (add_norm, add_norm._plan(x, x, ln.half(), ln.half(), 1e-5, True, True, TARGET)[2]),
        (add_norm, add_norm._plan(x, None, ln.half(), ln.half(), 1e-5, False, False, TARGET)[2]),
    ]


@pytest.mark.parametrize("case", range(7))
def test_a_launch_request_carries_what_triton_jit_would_compile(case, tmp_path):
    """Same signature (types, and int-1 arguments as constants), constexprs, divisibility attrs and
    parsed options as Triton's JIT computes for the same call: the cached binary is its binary."""
    module, launch = _launches()[case]
    _, args, constexprs, options, dtype = launch
    fam = module.LAUNCH.family
    req = module.LAUNCH.request(args, constexprs, options, dtype, ARCH)
    signature, consts, attrs, ours_options = fam.compile_inputs(req)
    jit_sig, jit_consts, jit_attrs, jit_options, backend = _jit_inputs(
        fam, args, constexprs, options, tmp_path
    )
    assert signature == jit_sig
    assert {(i,): v for i, v in consts.items()} == jit_consts
    assert {(i,): a for i, a in attrs.items()} == jit_attrs
    assert backend.parse_options(ours_options).__dict__ == jit_options.__dict__


def _imports(source: str) -> set[str]:
    """Every module a file of sparsegen.models imports, anywhere in it (inside functions too),
    relative imports resolved, and each imported name as `module.name`."""
    package = "sparsegen.models"
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base_mod = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            mod = ".".join(p for p in (base_mod, node.module or "") if p)
            out.add(mod)
            out.update(f"{mod}.{alias.name}" for alias in node.names)
    return out


def test_models_import_neither_triton_nor_the_jit():
    files = sorted(MODELS.glob("*.py"))
    assert files
    for path in files:
        found = _imports(path.read_text())
        bad = {m for m in found if m.split(".")[0] == "triton" or m.startswith("sparsegen.jit")}
        assert not bad, f"{path.name} imports {sorted(bad)}"
    # the check sees what it must refuse: relative, lazy and plain imports
    probe = "def f():\n    from ..jit import cache\n    import triton.language as tl\nfrom .. import jit\n"
    assert {"sparsegen.jit.cache", "triton.language", "sparsegen.jit"} <= _imports(probe)


def test_the_7b_plan_names_every_kind_and_the_tuned_builds():
    from sparsegen.models.config import Phi3SmallConfig
    from sparsegen.models.kernel_plan import model_kernel_requests

    reqs = model_kernel_requests(Phi3SmallConfig(), torch.bfloat16, ARCH)
    names = [base.key_of(r).name for r in reqs]
    assert {r.kind for r in reqs} == set(base.MODEL_KINDS) and len(set(names)) == len(names)
    assert "gemm_rows_bf16_n6144_k4096_t128x64x4x4_r16_rope128g4" in names  # TUNED_ROPE_TILES
    assert "gemv_bf16_k4096_rope128g4_norm_res_bias_pf_pdl_bn8_bk512_w4" in names  # gemv.TUNED_TILES
    assert {"rotary_kv_write_bf16_hkv8_g4_d128_bt1_cache_trigger", "rotary_kv_write_bf16_hkv8_g4_d128_bt16_cache_trigger"} <= set(names)  # fmt: skip


def test_compile_model_kernels_json_compiled_then_cached(fresh_cache, tmp_path):
    """`compile --model-kernels --json` for a (tiny) Phi-3-Small config.json: every model kind
    compiled, then every one cached, with the same keys."""
    from sparsegen.cli import cli
    from sparsegen.models.config import named_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(named_config("tiny").to_hf_dict()))
    args = [
        "compile",
        "--pattern",
        str(config),
        "--kind",
        "decode",
        "--model-kernels",
        "--arch",
        ARCH,
        "--json",
    ]
    first = CliRunner().invoke(cli, args)
    assert first.exit_code == 0, first.output
    records = json.loads(first.stdout)
    model = [r for r in records if r["kind"] != "decode"]
    assert {r["kind"] for r in model} == set(base.MODEL_KINDS) - {"gemm_rows"}  # tiny: no ROWS_LAYERS shape
    assert {r["status"] for r in records} == {"compiled"} and all(r["arch"] == ARCH for r in records)
    base.forget()
    second = CliRunner().invoke(cli, args)
    assert second.exit_code == 0, second.output
    again = json.loads(second.stdout)
    assert {r["status"] for r in again} == {"cached"}
    assert [r["key"] for r in again] == [r["key"] for r in records]


def test_model_kernels_need_a_phi3small_pattern():
    from sparsegen.cli import cli

    bad = CliRunner().invoke(cli, ["compile", "--pattern", "dense", "--model-kernels", "--arch", ARCH])
    assert bad.exit_code == 2 and "--model-kernels" in bad.output
