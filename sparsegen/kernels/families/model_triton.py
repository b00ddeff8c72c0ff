"""The families of the model's four Triton kernels: each names its template, its kernel's
arguments (runtime ones in order, then the constexprs) and how a kernel reads in its name. The
launches that make their requests are in `kernels.linear.gemv` and `kernels.fused.*`.
"""

from __future__ import annotations

from ..family import register
from .triton import TritonFamily


class GemvFamily(TritonFamily):
    kind = "gemv"
    template = "gemv.py.jinja"
    fn_name = "_gemv_kernel"
    arg_names = ("X", "W", "B", "Y", "N", "stride_w", "limit", "RES", "LNW", "LNB", "RES_OUT", "eps",
                 "COS", "SIN", "KC", "VC", "SLOT", "page_size", "stride_cp", "stride_co", "stride_ch")  # fmt: skip
    constexpr_names = ("K", "KP", "HAS_BIAS", "GEGELU", "NORM", "HAS_RES", "BLOCK_N", "BLOCK_K", "PREFETCH",
                       "ROW_SUM", "PDL", "ROPE", "HEAD_D", "G", "NORM_KIND", "ACT")  # fmt: skip

    def describe(self, c: dict, options: dict) -> str:
        act = ("gegelu", "swiglu", "geglu")[c["ACT"]]
        mode = act if c["GEGELU"] else f"rope{c['HEAD_D']}g{c['G']}" if c["ROPE"] else "plain"
        norm = ("norm", "rms", "rms1p")[c["NORM_KIND"]]
        flags = [(norm, c["NORM"]), ("res", c["HAS_RES"]), ("bias", c["HAS_BIAS"]), ("pf", c["PREFETCH"]),
                 ("rs", c["ROW_SUM"]), ("pdl", c["PDL"])]  # fmt: skip
        tile = f"bn{c['BLOCK_N']}_bk{c['BLOCK_K']}_w{options.get('num_warps', 4)}"
        return "_".join([f"k{c['K']}", mode, *(n for n, on in flags if on), tile])


class RotaryFamily(TritonFamily):
    kind = "rotary_kv_write"
    template = "rotary_kv_write.py.jinja"
    fn_name = "_rotary_qkv_kernel"
    arg_names = ("QKV", "COS", "SIN", "Q", "K", "V", "KC", "VC", "SLOTS", "n_tokens", "stride_t", "stride_c",
                 "stride_q", "stride_k", "stride_slot", "page_size", "stride_cp", "stride_co", "stride_ch", "KS",
                 "VS")  # fmt: skip
    constexpr_names = ("HKV", "G", "D", "BLOCK_T", "WRITE_CACHE", "TRIGGER", "FP8_MAX")
    do_not_specialize = ("n_tokens",)

    def describe(self, c: dict, options: dict) -> str:
        flags = [("cache", c["WRITE_CACHE"]), ("trigger", c["TRIGGER"]), ("fp8", c["FP8_MAX"])]
        return "_".join(
            [f"hkv{c['HKV']}_g{c['G']}_d{c['D']}_bt{c['BLOCK_T']}", *(n for n, on in flags if on)]
        )


class GegeluFamily(TritonFamily):
    kind = "gegelu"
    template = "gegelu.py.jinja"
    fn_name = "_gegelu_kernel"
    arg_names = ("X", "Y", "n_out", "limit")
    constexpr_names = ("BLOCK",)

    def describe(self, c: dict, options: dict) -> str:
        return f"b{c['BLOCK']}"


class AddNormFamily(TritonFamily):
    kind = "add_norm"
    template = "add_norm.py.jinja"
    fn_name = "_add_layer_norm_kernel"
    arg_names = ("X", "RES", "W", "B", "Y", "RES_OUT", "stride_x", "stride_res", "stride_y", "stride_res_out",
                 "n", "eps")  # fmt: skip
    constexpr_names = ("HAS_RES", "BLOCK", "PDL", "TRIGGER", "KIND")

    def describe(self, c: dict, options: dict) -> str:
        flags = [("res", c["HAS_RES"]), ("pdl", c["PDL"]), ("trigger", c["TRIGGER"])]
        kind = ("", "rms", "rms1p")[c["KIND"]]
        return "_".join([f"b{c['BLOCK']}_w{options.get('num_warps', 4)}", *([kind] if kind else []),
                         *(n for n, on in flags if on)])  # fmt: skip


GEMV = register(GemvFamily())
ROTARY = register(RotaryFamily())
GEGELU = register(GegeluFamily())
ADD_NORM = register(AddNormFamily())
