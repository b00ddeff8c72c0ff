"""Triton prefill builds: layer spec -> rendered module -> AOT-compiled cubin -> launchable kernel.

`plan(layer, config)` turns a `LayerSpec` into the typed constants the template needs (one
"path" per distinct head pattern). `build_files` renders the module and, for a GPU arch,
compiles it ahead of time with `triton.compile(ASTSource(...), target=GPUTarget(...))`; the
cubin and Triton's metadata JSON are what the cache entry stores, and `load_compiled` turns
them back into a launchable `CompiledKernel` with no recompilation. Under TRITON_INTERPRET=1
the entry holds only the module source, and `load_interpreted` imports its @triton.jit kernel.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

from ..codegen import render
from ..dtypes import resolve as resolve_dtype
from ..env import parse_arch
from ..errors import CompileError
from ..spec import HeadSpec, LayerSpec

TEMPLATE = "prefill_triton.py.jinja"
KERNEL_FN = "prefill_kernel"
SOURCE_FILE = "kernel.py"
INTERPRETER_ARCH = "interpreter"

# Kernel arguments in order (see the template's prefill_kernel); strides are in elements.
STRIDES = (
    "stride_qt",
    "stride_qh",
    "stride_kt",
    "stride_kh",
    "stride_vt",
    "stride_vh",
    "stride_ot",
    "stride_oh",
)
ARG_NAMES = ("Q", "K", "V", "O", "cu_seqlens_q", "cu_seqlens_k", "qk_scale", *STRIDES, "n_tiles")
# Arguments compiled as divisible by 16 (pointers: 16-byte aligned; strides: multiples of 16).
ALIGNED_ARGS = ("Q", "K", "V", "O", *STRIDES)


def pick_config(dtype: str, head_dim: int, arch: str) -> dict[str, int]:
    """Tile sizes and launch shape, chosen by rule (never autotuned, so the key pins them)."""
    if arch == INTERPRETER_ARCH:  # small tiles keep the interpreter quick
        return {"block_m": 32, "block_n": 16, "num_warps": 4, "num_stages": 1}
    cc = parse_arch(arch)
    if cc >= 90 or cc == 80:
        return {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3 if cc >= 90 else 2}
    return {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2}  # sm_86/89: ~100 KB smem


def _path_key(head: HeadSpec) -> tuple:
    """Heads that share everything but the vertical offset share one compiled path."""
    if head.dense:
        return ("dense",)
    return (head.kind, head.block_size, head.local_blocks, head.vert_stride, head.sliding_window)


def _ranges(heads: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for h in heads:
        if out and out[-1][1] == h:
            out[-1][1] = h + 1
        else:
            out.append([h, h + 1])
    return out


def _affine_offsets(heads: list[int], offsets: list[int], stride: int) -> tuple[int, int] | None:
    """(a, c) with offset(h) == (a*h + c) % stride for every head, if such a rule exists."""
    if stride > 64:
        return None
    for a in range(stride):
        for c in range(stride):
            if all((a * h + c) % stride == o for h, o in zip(heads, offsets)):
                return a, c
    return None


def plan(layer: LayerSpec, config: dict[str, int]) -> dict[str, Any]:
    """The template's constants: shapes, tile sizes and one dict per distinct head path."""
    groups: dict[tuple, list[int]] = {}
    for h, head in enumerate(layer.heads):
        groups.setdefault(_path_key(head), []).append(h)
    paths = []
    for pid, heads in enumerate(groups.values()):
        spec = layer.heads[heads[0]]
        offsets = [layer.heads[h].vert_offset for h in heads]
        affine = _affine_offsets(heads, offsets, spec.vert_stride) if spec.vert_stride else None
        paths.append(
            {
                "id": pid,
                "kind": spec.kind,
                "dense": spec.dense,
                "bs": spec.block_size,
                "local": 0 if spec.dense else spec.local_blocks,
                "vert": 0 if spec.dense else spec.vert_stride,
                "window": 0 if spec.dense else spec.sliding_window,
                "bnv": min(spec.block_size, config["block_n"]),
                "ranges": _ranges(heads),
                "affine": affine is not None,
                "off_a": affine[0] if affine else 0,
                "off_c": affine[1] if affine else 0,
                "offsets": [[h, o] for h, o in zip(heads, offsets)],
            }
        )
    d_pad = 1 << (layer.head_dim - 1).bit_length()
    return {
        "num_heads": layer.num_heads,
        "num_kv_heads": layer.num_kv_heads,
        "head_dim": layer.head_dim,
        "d_pad": d_pad,
        "pad_d": d_pad != layer.head_dim,
        "group": layer.group_size,
        "block_m": config["block_m"],
        "block_n": config["block_n"],
        "paths": paths,
    }


def render_source(layer: LayerSpec, config: dict[str, int]) -> str:
    return render(TEMPLATE, **plan(layer, config))


def import_module(path: Path, name: str) -> ModuleType:
    """Import a rendered kernel module from a file (Triton reads the jit functions' source)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CompileError(f"cannot import the rendered kernel {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise CompileError(f"the rendered kernel {path} does not import: {exc}") from exc
    return module


def signature(dtype: str) -> dict[str, str]:
    ptr = resolve_dtype(dtype).triton_pointer
    types = {"Q": ptr, "K": ptr, "V": ptr, "O": ptr, "cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32"}
    types["qk_scale"] = "fp32"
    types.update({s: "i32" for s in STRIDES})
    types["n_tiles"] = "i32"
    return types


def aot_compile(
    source: str, dtype: str, arch: str, config: dict[str, int], module_name: str
) -> dict[str, bytes]:
    """Compile the rendered module for `arch` (no GPU needed); returns Triton's files by name."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with tempfile.TemporaryDirectory(prefix="sparsegen-build-") as tmp:
        path = Path(tmp) / SOURCE_FILE
        path.write_text(source)
        module = import_module(path, module_name)
        try:
            fn = getattr(module, KERNEL_FN)
            attrs = {(ARG_NAMES.index(a),): [["tt.divisibility", 16]] for a in ALIGNED_ARGS}
            src = ASTSource(fn, signature(dtype), constexprs={}, attrs=attrs)
            options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
            if "maxnreg" in config:  # a register cap lets more programs share a multiprocessor
                options["maxnreg"] = config["maxnreg"]
            try:
                compiled = triton.compile(
                    src, target=GPUTarget("cuda", parse_arch(arch), 32), options=options
                )
            except Exception as exc:
                raise CompileError(f"Triton failed to compile the prefill kernel for {arch}: {exc}") from exc
        finally:
            sys.modules.pop(module_name, None)
    files = {Path(p).name: Path(p).read_bytes() for p in compiled.metadata_group.values()}
    if not any(n.endswith(".cubin") for n in files) or not any(n.endswith(".json") for n in files):
        raise CompileError(f"Triton's build for {arch} lacks a cubin or metadata: {sorted(files)}")
    return files


def load_compiled(files: dict[str, Path], dtype: str):
    """A launchable CompiledKernel from the stored cubin + metadata (no recompilation)."""
    from triton.compiler.compiler import CompiledKernel

    group = {name: str(path) for name, path in files.items() if name != SOURCE_FILE}
    meta_path = next(Path(p) for n, p in group.items() if n.endswith(".json"))
    kernel_hash = json.loads(meta_path.read_text()).get("hash", "")
    # The launcher only needs the signature and constants; the source module is not imported.
    src = SimpleNamespace(signature=signature(dtype), constants={}, fn=None)
    return CompiledKernel(src, group, kernel_hash)


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with int() of a 1-element array,
    which NumPy >= 2.4 refuses; loops with run-time bounds (ours) then fail. Take the element."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_sparsegen_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._sparsegen_index_fix = True
    interpreter._patch_lang_tensor = patched


def load_interpreted(files: dict[str, Path], module_name: str):
    """The @triton.jit kernel of the stored module, for Triton's interpreter."""
    _patch_interpreter_index()
    return getattr(import_module(files[SOURCE_FILE], module_name), KERNEL_FN)
