"""One table of the floating-point dtypes sparsegen knows: torch dtype <-> short name <-> C type
<-> Triton type. Everything that needs a dtype's other spelling looks it up here.

    dtypes.resolve(torch.bfloat16).name     # "bf16"
    dtypes.resolve("bf16").ctype            # "__nv_bfloat16" (CUDA C++)
    dtypes.resolve("bfloat16").triton       # "bf16" (Triton's type; "*bf16" is its pointer)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InputError


@dataclass(frozen=True)
class DType:
    torch: torch.dtype
    name: str  # short name: keys, kernel names, CLI options ("bf16")
    torch_name: str  # torch's attribute name ("bfloat16")
    ctype: str  # CUDA C++ type
    triton: str  # Triton's scalar type; its pointer type is "*" + triton
    kernel: bool  # compiled kernels (prefill and decode) support it; fp32 runs in the interpreter only

    @property
    def triton_pointer(self) -> str:
        return "*" + self.triton


TABLE: tuple[DType, ...] = (
    DType(torch.float16, "fp16", "float16", "__half", "fp16", True),
    DType(torch.bfloat16, "bf16", "bfloat16", "__nv_bfloat16", "bf16", True),
    DType(torch.float32, "fp32", "float32", "float", "fp32", False),
)
BY_TORCH = {d.torch: d for d in TABLE}
BY_NAME = {**{d.name: d for d in TABLE}, **{d.torch_name: d for d in TABLE}}
KERNEL_DTYPES = tuple(d.torch for d in TABLE if d.kernel)  # (torch.float16, torch.bfloat16)
REFERENCE_DTYPES = (*(d.torch for d in TABLE), torch.float64)  # the oracle also takes float64
CLI_NAMES = tuple(d.name for d in TABLE if d.kernel)  # ("fp16", "bf16")


def resolve(dtype: object, *, kernel: bool = False, what: str = "dtype") -> DType:
    """The table row for a torch dtype or a name ("bf16" / "bfloat16"); InputError otherwise.
    `kernel=True` also refuses dtypes the compiled kernels do not support (fp32)."""
    row = None
    if isinstance(dtype, torch.dtype):
        row = BY_TORCH.get(dtype)
    elif isinstance(dtype, str):
        row = BY_NAME.get(dtype)
    if row is None or (kernel and not row.kernel):
        allowed = [d.name for d in TABLE if d.kernel or not kernel]
        raise InputError(f"{what} must be one of {allowed} (or the torch dtypes), got {dtype!r}")
    return row


def name(dtype: object) -> str:
    """'bf16' for torch.bfloat16 or 'bfloat16'; InputError for anything not in the table."""
    return resolve(dtype).name


# fp8 KV caches: the cache holds fp8 bytes, and the kernels dequantise with per-KV-head (or
# per-tensor) float32 scales: key = k.float() * k_scale[kv_head]. vLLM's names.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
KV_CACHE_DTYPE_NAMES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_NAMES = {torch.float8_e4m3fn: "fp8e4m3", torch.float8_e5m2: "fp8e5m2"}  # in kernel names and keys


def is_fp8(dtype: object) -> bool:
    return dtype in FP8_DTYPES


def kv_kernel_name(kv_dtype: object) -> str:
    """A kernel request's KV dtype: '' for None (K/V of q's dtype), else the FP8_NAMES name of
    an fp8 torch dtype, an engine name ("fp8", "fp8_e4m3", "fp8_e5m2") or an FP8_NAMES name
    ("fp8e4m3"); InputError otherwise."""
    if kv_dtype is None:
        return ""
    if isinstance(kv_dtype, str):
        if kv_dtype in FP8_NAMES.values():
            return kv_dtype
        kv_dtype = KV_CACHE_DTYPE_NAMES.get(kv_dtype, kv_dtype)
    if isinstance(kv_dtype, torch.dtype) and kv_dtype in FP8_NAMES:
        return FP8_NAMES[kv_dtype]
    allowed = [None, *FP8_NAMES.values(), *KV_CACHE_DTYPE_NAMES, *map(str, FP8_DTYPES)]
    raise InputError(f"kv_dtype must be one of {allowed}, got {kv_dtype!r}")
