"""The Hopper (sm_90) prefill kernel in Gluon: variant "gluon" of the prefill family.

    kernel = sparsegen.get_kernel(layer, "prefill", dtype=torch.bfloat16)   # on an H100/H200
    out = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k)                        # q: [Tq, H, D]

`impl="triton"` (and `get_kernel` with no `variant`) takes this kernel for sm_90 whenever
`prefill_gluon_template.covers` accepts the layer and dtype, unless SPARSEGEN_PREFILL_TL=1 or
`variant="tl"` asks for the tl kernel (`base.default_variant`). The module is rendered from
`templates/prefill_gluon.py.jinja` (constants from `prefill_gluon_template.plan`) and compiled
ahead of time through Gluon's AST source for sm_90: no GPU is needed to build it, only to run
it. K and V reach the kernel as TMA descriptors made per call on the host: over a 2-D view for
head_dim 64, 128 and 256, over K and V themselves (3-D, zero-filled past head_dim) for the padded
head dims (the other multiples of 16 from 48 to 240). A learned-sinks layer takes `Sinks` ([H]
float32) after O.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from ... import env
from ...errors import ImplUnavailableError, InputError
from ...jit import triton_build
from ...spec import LayerSpec
from .. import gluon_api
from .. import prefill_gluon_template as tpl
from ..family import Family, Request, register
from ..naming import pattern_name
from ..prefill_template import feature_suffix
from .prefill_tl import Launch, PrefillKernel

ARCH = "sm_90"
LOG2E = 1.4426950408889634
KERNEL_FN = "prefill_kernel"
SOURCE_FILE = "kernel.py"
POINTERS = {"fp16": "*fp16", "bf16": "*bf16"}
ARG_NAMES = (
    "Q", "O", "k_desc", "v_desc", "cu_seqlens_q", "cu_seqlens_k", "qk_scale",
    "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kh", "stride_vh", "bh_count", "n_q_tiles",
)  # fmt: skip
ALIGNED_ARGS = ("Q", "O", "stride_qt", "stride_qh", "stride_ot", "stride_oh")


def arg_names(layer: LayerSpec) -> tuple[str, ...]:
    """prefill_kernel's parameters for `layer`: a learned-sinks layer adds `Sinks` after O."""
    return (*ARG_NAMES[:2], "Sinks", *ARG_NAMES[2:]) if layer.learned_sinks else ARG_NAMES


def _kv_block(layer: LayerSpec, cfg: dict[str, Any]) -> list[int]:
    """One TMA box: a key tile, or half of one when tiles are two chunks (vpair). A padded head_dim
    (96) has a 3-D box [keys, 1, tile width] over [Tk, Hkv, D]: the columns past D are zero fill."""
    keys = cfg["block_n"] // 2 if cfg["vpair"] else cfg["block_n"]
    width = tpl.tile_dim(layer.head_dim)
    return [keys, 1, width] if width != layer.head_dim else [keys, layer.head_dim]


def signature(layer: LayerSpec, dtype: str, cfg: dict[str, Any]) -> dict[str, str]:
    layout = gluon_api.shared_layout(_kv_block(layer, cfg), dtype)
    desc = gluon_api.descriptor_type(dtype, _kv_block(layer, cfg), layout)
    types = {"Q": POINTERS[dtype], "O": POINTERS[dtype], "Sinks": "*fp32", "k_desc": desc, "v_desc": desc}
    types.update({"cu_seqlens_q": "*i32", "cu_seqlens_k": "*i32", "qk_scale": "fp32"})
    types.update(
        {s: "i32" for s in ARG_NAMES[7:]}  # strides (elements) and the work-item counts
    )
    return {name: types[name] for name in arg_names(layer)}  # in the kernel's parameter order


def aot_compile(
    source: str, layer: LayerSpec, dtype: str, cfg: dict[str, Any], module_name: str
) -> dict[str, bytes]:
    """Compile the rendered module for sm_90 (no GPU needed); returns Triton's files by name."""
    return triton_build.aot_compile(
        source,
        fn_name=KERNEL_FN,
        signature=signature(layer, dtype, cfg),
        aligned=ALIGNED_ARGS,
        arch=ARCH,
        options={"num_warps": cfg["num_warps"], "maxnreg": cfg["maxnreg"]},
        module_name=module_name,
        source_file=SOURCE_FILE,
        ast_source=gluon_api.AST_SOURCE,
    )


def _load_compiled(files: dict[str, Path], layer: LayerSpec, dtype: str, cfg: dict[str, Any]):
    """The launchable kernel from the stored cubin + metadata (no recompilation)."""
    return triton_build.load_compiled(files, signature(layer, dtype, cfg), SOURCE_FILE)


class GluonPrefillKernel(PrefillKernel):
    """The sm_90 Gluon prefill kernel for one request; call it like `sparsegen.prefill` (the checks
    are PrefillKernel's: validate.check_prefill_inputs, then dtype, device and arch)."""

    @property
    def ptx(self) -> str:
        return (self.path / f"{KERNEL_FN}.ptx").read_text()

    def prepare(self, q, k, v, cu_seqlens_q, cu_seqlens_k, scale: float, *, max_seqlen_k=None,
                sinks=None) -> Launch:  # fmt: skip
        """The output, TMA descriptors, grid and arguments of a launch (see PrefillKernel.prepare);
        `sinks` ([H] float32, checked by validate.check_features) exactly when the layer has
        learned sinks."""
        if (sinks is not None) != self.layer.learned_sinks:
            raise InputError(f"sinks= must be given exactly when the layer has learned_sinks "
                             f"(learned_sinks={self.layer.learned_sinks})")  # fmt: skip
        if isinstance(self._entry, dict):
            raise ImplUnavailableError(
                f"kernel {self.key} was compiled ahead of time for {ARCH}; it runs only on an sm_90 GPU"
            )
        out = torch.empty_like(q)  # [Tq, H, D]; q passed the alignment policy (validate)
        if env.flag("SPARSEGEN_POISON_OUTPUT"):  # NaN-filled outputs show unwritten rows
            out.fill_(float("nan"))
        # Tk (or max_seqlen_k) bounds every sequence's k_len: no device sync.
        tk = k.shape[0] if max_seqlen_k is None else min(int(max_seqlen_k), k.shape[0])
        if q.shape[0] == 0 or tk == 0:
            return Launch(out)
        d, hkv = self.layer.head_dim, self.layer.num_kv_heads
        block = _kv_block(self.layer, self.config)
        layout = gluon_api.shared_layout(block, self.request.dtype)
        view = _heads if tpl.tile_dim(d) != d else _rows  # padded tiles: 3-D descriptors
        (k_view, stride_kh), (v_view, stride_vh) = view(k, hkv, d), view(v, hkv, d)
        k_desc = gluon_api.descriptor(k_view, block, layout)
        v_desc = gluon_api.descriptor(v_view, block, layout)
        n_q_tiles = -(-tk // self.config["block_m"])
        bh_count = (cu_seqlens_q.shape[0] - 1) * self.layer.num_heads
        n_items = bh_count * n_q_tiles
        programs = self.config["persistent"] and (self.config["programs"] or _sm_count(q.device))
        grid = (min(n_items, programs) if programs else n_items, 1, 1)
        feature_args = (sinks,) if self.layer.learned_sinks else ()
        args = (
            q, out, *feature_args, k_desc, v_desc, cu_seqlens_q, cu_seqlens_k, scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_kh, stride_vh, bh_count, n_q_tiles,
        )  # fmt: skip
        return Launch(out, self._entry[grid], args, q.device)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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


def _heads(t: torch.Tensor, hkv: int, d: int) -> tuple[torch.Tensor, int]:
    """k or v [Tk, Hkv, D] as the 3-D view a padded head_dim's descriptor covers (strides s_t, s_h, 1),
    and its head stride. A box wider than D stops at the end of the last dim (TMA zero-fills the
    rest), so it never reads another head's columns. Views into a fused qkv buffer need no copy;
    other layouts are copied first: TMA-illegal ones (unaligned base, token or head stride, a strided
    last dim) and any whose strides are not outer-to-inner without overlap (head-major buffers)."""
    s_t, s_h = t.stride(0), (t.stride(1) if hkv > 1 else d)  # one head: s_h is never stepped over
    aligned = all((s * t.element_size()) % 16 == 0 for s in (s_t, s_h)) and t.data_ptr() % 16 == 0
    if not (t.stride(2) == 1 and s_h >= d and s_t >= hkv * s_h and aligned):
        t = t.clone(memory_format=torch.contiguous_format)  # fresh, row-major strides
        s_t, s_h = t.stride(0), d
    return t.as_strided((t.shape[0], hkv, d), (s_t, s_h, 1)), s_h


class GluonPrefill(Family):
    kind = "prefill"
    variant = "gluon"
    source_file = SOURCE_FILE
    features = tpl.FEATURES
    head_dims = tpl.HEAD_DIMS

    def check(self, request: Request) -> None:
        if request.arch != ARCH:
            raise ImplUnavailableError(
                f"the Gluon prefill kernel is built for {ARCH} only, not {request.arch}"
            )
        missing = gluon_api.available()
        if missing:
            raise ImplUnavailableError(f"the installed Triton has no usable Gluon: {missing}")
        why = tpl.covers(request.layer, request.dtype)
        if why:
            raise ImplUnavailableError(f"the Gluon prefill kernel does not cover this layer: {why}")
        unknown = sorted(set(request.knobs) - set(tpl.CONFIG))
        if unknown:
            raise InputError(f"unknown Gluon prefill config knobs {unknown}; known: {sorted(tpl.CONFIG)}")
        if request.params.knobs:
            self.config(request)  # a knob the layer cannot take: InputError before any build

    def config(self, request: Request) -> dict[str, Any]:
        return tpl.config(request.layer, **request.knobs)

    def name(self, request: Request) -> str:
        """prefill_gluon_<dtype>_<shapes>_<pattern><features>, then each config knob of the request (`_stages2`)."""
        layer = request.layer
        shapes = f"hd{layer.head_dim}_h{layer.num_heads}kv{layer.num_kv_heads}"
        knobs = "".join(f"_{k}{int(v)}" for k, v in request.params.knobs)
        return f"prefill_gluon_{request.dtype}_{shapes}_{pattern_name(layer)}{feature_suffix(layer)}{knobs}"

    def render(self, request: Request) -> str:
        return tpl.render_source(request.layer, request.dtype, self.config(request))

    def build(self, request: Request, source: str, module_name: str) -> dict[str, bytes]:
        return aot_compile(source, request.layer, request.dtype, self.config(request), module_name)

    def required(self, request: Request) -> tuple[str, ...]:
        return (SOURCE_FILE, f"{KERNEL_FN}.cubin", f"{KERNEL_FN}.json", f"{KERNEL_FN}.ptx")

    def load(
        self, request, files: dict[str, Path], key: str, path: Path, module_name: str
    ) -> GluonPrefillKernel:
        source = files[SOURCE_FILE].read_text()
        cfg = self.config(request)
        if env.current_arch() != ARCH:
            entry = dict(files)  # compiled ahead of time: the files only
        else:
            entry = _load_compiled(files, request.layer, request.dtype, cfg)
        return GluonPrefillKernel(request, key, self.name(request), path, source, cfg, entry)


register(GluonPrefill())
