"""The Hopper (sm_90) prefill kernel in Gluon: build, load and launch.

    kernel = get_gluon_prefill_kernel(layer, dtype=torch.bfloat16)   # AOT-compiled once, then cached
    out = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k)                 # q: [Tq, H, D] -> [Tq, H, D]

The module is rendered from `templates/prefill_gluon.py.jinja` (constants from
`prefill_gluon_template.plan`) and compiled ahead of time through Gluon's AST source for
sm_90; no GPU is needed to build it, only to run it. K and V reach the kernel as TMA
descriptors over their [Tk, Hkv * D] view, made per call on the host.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..codegen import template_bytes
from ..errors import CompileError, ImplUnavailableError, InputError
from ..jit import cache
from ..spec import LayerSpec
from ..validate import check_prefill_inputs, softmax_scale
from . import gluon_api
from . import prefill_gluon_template as tpl

ARCH = "sm_90"
LOG2E = 1.4426950408889634
KERNEL_FN = "prefill_kernel"
SOURCE_FILE = "kernel.py"
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
POINTERS = {"fp16": "*fp16", "bf16": "*bf16"}
ARG_NAMES = (
    "Q", "O", "k_desc", "v_desc", "cu_seqlens_q", "cu_seqlens_k", "qk_scale",
    "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kh", "stride_vh", "bh_count", "n_q_tiles",
)  # fmt: skip
ALIGNED_ARGS = ("Q", "O", "stride_qt", "stride_qh", "stride_ot", "stride_oh")

_MEMO: dict[tuple, GluonPrefillKernel] = {}


def _kv_block(layer: LayerSpec, cfg: dict[str, Any]) -> list[int]:
    return [cfg["block_n"], layer.head_dim]


def signature(layer: LayerSpec, dtype: str, cfg: dict[str, Any]) -> dict[str, str]:
    layout = gluon_api.shared_layout(_kv_block(layer, cfg), dtype)
    desc = gluon_api.descriptor_type(dtype, _kv_block(layer, cfg), layout)
    types = {"Q": POINTERS[dtype], "O": POINTERS[dtype], "k_desc": desc, "v_desc": desc}
    types.update({"cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "qk_scale": "fp32"})
    types.update(
        {s: "i32" for s in ARG_NAMES[7:]}  # strides (elements) and the work-item counts
    )
    return types


def kernel_name(layer: LayerSpec, dtype: str) -> str:
    """Readable half of the key, e.g. prefill_gluon_bf16_hd128_h32kv8_bs64_l16_v8."""
    base = f"prefill_gluon_{dtype}_hd{layer.head_dim}_h{layer.num_heads}kv{layer.num_kv_heads}"
    distinct = {(h.kind, h.block_size, h.local_blocks, h.vert_stride, h.sliding_window) for h in layer.heads}
    if len(distinct) > 1:
        return f"{base}_hybrid{len(distinct)}"
    head = layer.heads[0]
    if head.dense:
        return f"{base}_dense"
    parts = [f"bs{head.block_size}"]
    parts += [f"l{head.local_blocks}"] if head.local_blocks else []
    parts += [f"v{head.vert_stride}"] if head.vert_stride else []
    parts += [f"w{head.sliding_window}"] if head.sliding_window else []
    return "_".join([base, *parts])


def _import(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CompileError(f"cannot import the rendered Gluon kernel {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise CompileError(f"the rendered Gluon kernel {path} does not import: {exc}") from exc
    return module


def aot_compile(
    source: str, layer: LayerSpec, dtype: str, cfg: dict[str, Any], module_name: str
) -> dict[str, bytes]:
    """Compile the rendered module for sm_90 (no GPU needed); returns Triton's files by name."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory(prefix="sparsegen-gluon-") as tmp:
        path = Path(tmp) / SOURCE_FILE
        path.write_text(source)
        module = _import(path, module_name)
        try:
            attrs = {(ARG_NAMES.index(a),): [["tt.divisibility", 16]] for a in ALIGNED_ARGS}
            src = gluon_api.GluonASTSource(
                getattr(module, KERNEL_FN), signature(layer, dtype, cfg), {}, attrs
            )
            options = {"num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]}
            try:
                compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
            except Exception as exc:
                raise CompileError(
                    f"Triton failed to compile the Gluon prefill kernel for sm_90: {exc}"
                ) from exc
        finally:
            sys.modules.pop(module_name, None)
    files = {Path(p).name: Path(p).read_bytes() for p in compiled.metadata_group.values()}
    if not any(n.endswith(".cubin") for n in files) or not any(n.endswith(".json") for n in files):
        raise CompileError(f"Triton's Gluon build lacks a cubin or metadata: {sorted(files)}")
    return files


def _load_compiled(files: dict[str, Path], layer: LayerSpec, dtype: str, cfg: dict[str, Any]):
    from triton.compiler.compiler import CompiledKernel

    group = {name: str(path) for name, path in files.items() if name != SOURCE_FILE}
    meta_path = next(Path(p) for n, p in group.items() if n.endswith(".json"))
    kernel_hash = json.loads(meta_path.read_text()).get("hash", "")
    src = SimpleNamespace(signature=signature(layer, dtype, cfg), constants={}, fn=None)
    return CompiledKernel(src, group, kernel_hash)


def _current_arch() -> str | None:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return None


@dataclass
class GluonPrefillKernel:
    """The sm_90 Gluon prefill kernel for one layer spec and dtype; call it like `prefill`."""

    layer: LayerSpec
    dtype: torch.dtype
    name: str
    key: str
    path: Path
    status: str
    seconds: float
    config: dict[str, Any]
    arch: str = ARCH
    _entry: Any = field(repr=False, default=None)  # CompiledKernel on an sm_90 GPU, else the files

    @property
    def source(self) -> str:
        return (self.path / SOURCE_FILE).read_text()

    @property
    def ptx(self) -> str:
        return next(p for p in self.path.iterdir() if p.name.endswith(".ptx")).read_text()

    def __call__(self, q, k, v, cu_seqlens_q, cu_seqlens_k, layer=None, scale=None, *, check=True):
        """q: [Tq, H, D], k/v: [Tk, Hkv, D] -> [Tq, H, D]. check=False skips the host read of
        cu_seqlens (no device sync)."""
        if layer is not None and layer is not self.layer and layer != self.layer:
            raise InputError("layer differs from the spec this kernel was compiled for")
        if check:
            check_prefill_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, self.layer, allow_cpu=False)
        if isinstance(self._entry, dict):
            raise ImplUnavailableError(
                f"kernel {self.key} was compiled ahead of time for {ARCH}; it runs only on an sm_90 GPU"
            )
        if q.dtype != self.dtype or k.dtype != self.dtype or v.dtype != self.dtype:
            raise InputError(f"q, k, v must be {self.dtype}, got {q.dtype}, {k.dtype}, {v.dtype}")
        if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
            raise InputError(f"q must be on an sm_90 GPU for the Gluon kernel, got {q.device}")
        scale = softmax_scale(scale, self.layer.head_dim)
        q = _aligned(q)  # q: [Tq, H, D]
        out = torch.empty_like(q)  # [Tq, H, D]
        if _poisoning():
            out.fill_(float("nan"))
        tk = k.shape[0]
        if q.shape[0] == 0 or tk == 0:
            return out
        d, hkv = self.layer.head_dim, self.layer.num_kv_heads
        dname = DTYPE_NAMES[self.dtype]
        block = _kv_block(self.layer, self.config)
        layout = gluon_api.shared_layout(block, dname)
        (k_rows, stride_kh), (v_rows, stride_vh) = _rows(k, hkv, d), _rows(v, hkv, d)
        k_desc = gluon_api.descriptor(k_rows, block, layout)
        v_desc = gluon_api.descriptor(v_rows, block, layout)
        # Tk bounds every sequence's k_len: no device sync; items past a sequence's end exit at once.
        n_q_tiles = -(-tk // self.config["block_m"])
        bh_count = (cu_seqlens_q.shape[0] - 1) * self.layer.num_heads
        n_items = bh_count * n_q_tiles
        programs = self.config["persistent"] and (self.config["programs"] or _sm_count(q.device))
        grid = (min(n_items, programs) if programs else n_items, 1, 1)
        args = (
            q, out, k_desc, v_desc, cu_seqlens_q, cu_seqlens_k, scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_kh, stride_vh, bh_count, n_q_tiles,
        )  # fmt: skip
        with torch.cuda.device(q.device):
            stream = torch.cuda.current_stream(q.device).cuda_stream
            self._entry[grid](*args, stream=stream)
        return out


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _poisoning() -> bool:
    import os

    return os.environ.get("SPARSEGEN_POISON_OUTPUT", "0").strip().lower() not in (
        "",
        "0",
        "false",
        "no",
        "off",
    )


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """The kernel is compiled for 16-byte-aligned Q/O pointers and strides divisible by 16."""
    if t.data_ptr() % 16 or t.stride(0) % 16 or t.stride(1) % 16 or t.stride(2) != 1:
        t = t.contiguous()
        if t.data_ptr() % 16:
            t = t.clone()
    return t


def _rows(t: torch.Tensor, hkv: int, d: int) -> tuple[torch.Tensor, int]:
    """k or v [Tk, Hkv, D] as the 2-D view TMA reads, and its head stride: [Tk, (Hkv - 1) * s_h + D]
    with strides (s_t, 1), so KV head g's D columns start at column g * s_h of each row. Views into
    a fused qkv buffer need no copy; only TMA-illegal layouts (unaligned base or token stride,
    overlapping heads, a strided last dim) are copied first."""
    s_t, s_h = t.stride(0), t.stride(1)
    legal = t.stride(2) == 1 and s_t > 0 and (hkv == 1 or s_h >= d)
    if not (legal and (s_t * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0):
        t = t.contiguous()
        s_t, s_h = t.stride(0), t.stride(1)
    s_h = s_h if hkv > 1 else d
    return t.as_strided((t.shape[0], (hkv - 1) * s_h + d), (s_t, 1)), s_h


def _key(layer: LayerSpec, dname: str, source: str, cfg: dict[str, Any]) -> cache.KernelKey:
    api = Path(gluon_api.__file__).read_bytes()
    return cache.make_key(
        kernel_name(layer, dname),
        spec_json=layer.to_json(),
        template=template_bytes(tpl.TEMPLATE),
        arch=ARCH,
        extra={
            "kind": "prefill",
            "variant": "gluon",
            "dtype": dname,
            "config": cfg,
            "source_sha256": hashlib.sha256(source.encode()).hexdigest(),
            "gluon_api_sha256": hashlib.sha256(api).hexdigest(),
        },
    )


def get_gluon_prefill_kernel(layer: LayerSpec, *, dtype, **overrides) -> GluonPrefillKernel:
    """The sm_90 Gluon kernel for `layer` (compiled on first use, then from the cache).

    Raises ImplUnavailableError when the installed Triton lacks Gluon or the kernel does not
    cover the spec (`prefill_gluon_template.covers`)."""
    if not isinstance(layer, LayerSpec):
        raise InputError(f"layer must be a sparsegen.LayerSpec, got {type(layer).__name__}")
    memo_key = (layer, dtype, tuple(sorted(overrides.items())))
    hit = _MEMO.get(memo_key)
    if hit is not None:
        return hit
    dname = DTYPE_NAMES.get(dtype)
    if dname is None:
        raise InputError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    missing = gluon_api.available()
    if missing:
        raise ImplUnavailableError(f"the installed Triton has no usable Gluon: {missing}")
    why = tpl.covers(layer, dname)
    if why:
        raise ImplUnavailableError(f"the Gluon prefill kernel does not cover this layer: {why}")
    cfg = tpl.config(layer, **overrides)
    source = tpl.render_source(layer, dname, cfg)
    key = _key(layer, dname, source, cfg)
    module_name = f"sparsegen_gluon_{key.digest[:24]}"

    def build():
        files = {SOURCE_FILE: source.encode()}
        files.update(aot_compile(source, layer, dname, cfg, module_name))
        meta = {"kind": "prefill", "variant": "gluon", "name": key.name, "arch": ARCH, "dtype": dname}
        return files, meta

    def load(files: dict[str, Path]):
        if _current_arch() != ARCH:
            return dict(files)  # built ahead of time: the files only
        return _load_compiled(files, layer, dname, cfg)

    required = (SOURCE_FILE, f"{KERNEL_FN}.cubin", f"{KERNEL_FN}.json", f"{KERNEL_FN}.ptx")
    found = cache.load_or_build(key, build, load, required=required, label=f"{key.name} for {ARCH}")
    status = "cached" if found.status == "memory" else found.status
    kernel = GluonPrefillKernel(
        layer, dtype, key.name, key.key, found.path, status, found.seconds, cfg, ARCH, found.value
    )
    _MEMO[memo_key] = kernel
    return kernel
