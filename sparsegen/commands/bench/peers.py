"""The prefill peers of `sparsegen bench`: FlashAttention-4, FlexAttention (Triton and FLASH
backends) and SDPA, each given the same q / k / v and the same attention as sparsegen's kernel.

Every `time_*` returns (ms, out) or (a string "n/a (why)", None): a peer that cannot express the
layer, is not installed, or fails says so in its column, and never stands in with a number.
`timer` is the function that times a callable (default `median_ms`, CUDA events); tests pass
their own. FA4 is `flash_attn.cute.flash_attn_func` (package `flash-attn-4`, the `bench` extra):
q [B, S, H, D], k / v [B, S, Hkv, D], keyword arguments only, returns (out, lse). FlexAttention's
FLASH backend runs FA4's kernels too, so without `flash_attn.cute` both columns read
NOT_INSTALLED.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from ... import flex as sg_flex
from ...spec import LayerSpec
from .common import median_ms

NOT_INSTALLED = "n/a (flash_attn.cute not installed)"


def _short(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}".rstrip(": ")


def fa4_module():
    """`flash_attn.cute`, or the "n/a (...)" string saying why it is not there."""
    try:
        return importlib.import_module("flash_attn.cute")
    except ModuleNotFoundError:
        return NOT_INSTALLED
    except Exception as exc:  # noqa: BLE001 - a broken install is named, not hidden
        return f"n/a (flash_attn.cute failed to import: {_short(exc)})"


def fa4_kwargs(layer: LayerSpec, sinks: torch.Tensor | None) -> dict | str:
    """FA4's keyword arguments for `layer`, or "n/a (why)" where FA4 cannot express it: every
    head must share one pattern, either dense causal or a plain sliding window (FA4's
    window_size=(w - 1, 0): the key w - 1 before the query is the oldest one seen)."""
    head = layer.heads[0]
    if any(h != head for h in layer.heads):
        return "n/a (FA4 takes one pattern for every head)"
    kw: dict = {"causal": True, "softmax_scale": layer.default_scale}
    if head.kind == "window":
        kw["window_size"] = (head.sliding_window - 1, 0)
    elif head.kind != "dense":
        return f"n/a (FA4 has no {head.kind} pattern)"
    if layer.logit_softcap:
        kw["softcap"] = layer.logit_softcap
    if layer.learned_sinks:
        if sinks is None:
            return "n/a (the layer has learned sinks, but no sinks were given)"
        kw["learnable_sink"] = sinks
    return kw


def time_fa4(layer: LayerSpec, q, k, v, sinks=None, *, timer: Callable = median_ms):
    """FA4 on q [S, H, D], k / v [S, Hkv, D] (one sequence): (ms, out [S, H, D]) or ("n/a ...", None)."""
    mod = fa4_module()
    if isinstance(mod, str):
        return mod, None
    kw = fa4_kwargs(layer, sinks)
    if isinstance(kw, str):
        return kw, None
    qb, kb, vb = (x.unsqueeze(0) for x in (q, k, v))  # [1, S, H|Hkv, D]

    def run():
        got = mod.flash_attn_func(qb, kb, vb, **kw)
        return got[0] if isinstance(got, tuple) else got  # (out, lse)

    try:
        out = run()  # compiles on the first call, outside the timing
        return timer(run), out[0]
    except Exception as exc:  # noqa: BLE001 - an FA4 build that refuses the case says why
        return f"n/a (FA4: {_short(exc)})", None


def time_flex(layer: LayerSpec, q, k, v, sinks=None, *, backend: str = "TRITON", block_mask=None,
              timer: Callable = median_ms):  # fmt: skip
    """FlexAttention with sparsegen's block mask, the layer's soft-cap as a score_mod and learned
    sinks applied to its lse (`sparsegen.flex`), on backend "TRITON" (its default kernels) or
    "FLASH" (FA4's): (ms, out [S, H, D]) or ("n/a ...", None)."""
    if backend == "FLASH" and isinstance(fa4_module(), str):
        return fa4_module(), None
    try:
        from torch.nn.attention.flex_attention import flex_attention

        n = q.shape[0]
        if block_mask is None:
            block_mask = sg_flex.block_mask(layer, n, n, device=q.device, compile=q.is_cuda)
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H|Hkv, S, D]
        fn = torch.compile(flex_attention, dynamic=False) if q.is_cuda else flex_attention
        kw = {"block_mask": block_mask, "score_mod": sg_flex.score_mod(layer), "scale": layer.default_scale,
              "enable_gqa": True}  # fmt: skip
        if backend != "TRITON":
            kw["kernel_options"] = {"BACKEND": backend}
        if sinks is not None:
            kw.update(_lse_request())

        def run():
            got = fn(qt, kt, vt, **kw)
            if sinks is None:
                return got
            out, aux = got
            lse = getattr(aux, "lse", aux)  # AuxOutput (torch >= 2.9) or the lse tensor
            return sg_flex.apply_learned_sinks(out, lse, sinks)

        out = run()
        return timer(run), out[0].transpose(0, 1)
    except Exception as exc:  # noqa: BLE001 - the other columns still count
        return f"n/a (flex {backend}: {_short(exc)})", None


def _lse_request() -> dict:
    """FlexAttention's argument asking for the log-sum-exp: return_aux=AuxRequest(lse=True)
    where torch has it (return_lse is deprecated there), else return_lse=True."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def time_sdpa(layer: LayerSpec, q, k, v, *, timer: Callable = median_ms):
    """SDPA is a peer only where it computes the same attention: a dense causal layer without
    soft-cap or sinks (the dense causal SDPA of every row is `sdpa_dense_ms`, a reference)."""
    if not layer.is_dense or layer.features:
        return "n/a (SDPA computes dense causal attention, not this layer's)", None
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H|Hkv, S, D]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        return sdpa(qt, kt, vt, is_causal=True, enable_gqa=True, scale=layer.default_scale)

    out = run()
    return timer(run), out[0].transpose(0, 1)
