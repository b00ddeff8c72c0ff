"""`ModelOptions`: how a Phi-3-Small model is built (device, dtype, attention), checked once.

`empty_model`, `random_model`, `load_checkpoint` and `Phi3SmallForCausalLM` each take one
`ModelOptions` (or its fields as keywords, which build one), instead of forwarding the same
keyword arguments through every layer of calls.

    opts = ModelOptions(device="cuda", dtype=torch.bfloat16, attn_impl=None)
    model = random_model("7b", opts, seed=0)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from ..errors import InputError

# attn_impl -> (prefill impl, decode impl) passed to sparsegen.prefill / sparsegen.paged_decode.
# None picks per device (kernels on a GPU, the reference on a CPU); "triton" forces the generated
# prefill kernel (also under TRITON_INTERPRET=1 on a CPU) and lets decode pick per device;
# "reference" is the plain-PyTorch oracle model (no fused kernels either).
ATTN_IMPLS: dict[str | None, tuple[str | None, str | None]] = {
    None: (None, None),
    "reference": ("reference", "reference"),
    "triton": ("triton", None),
}
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class ModelOptions:
    device: torch.device = torch.device("cpu")  # a str such as "cuda:0" is accepted and converted
    dtype: torch.dtype = torch.float32
    force_dense: bool = False  # every layer dense (same weights), for comparison
    attn_impl: str | None = None  # a key of ATTN_IMPLS
    dummy_token_indices: tuple[int, ...] = ()  # ids whose logits are masked, when config.json has none
    # Batch-1 linear layers through sparsegen's Triton GEMV (`kernels.linear.gemv`: the residual adds and
    # LayerNorms inside the QKV, up_proj and lm_head GEMVs, GeGeLU inside up_proj's, the rotary
    # and K/V cache write inside QKV's at a decode step) instead of cuBLAS, on a GPU (or in
    # Triton's interpreter). None: on for a CUDA device, not for the reference model (`gemv_on`).
    # Measured on the H200 (benchmarks/engine/ab_decode_step.py, one process): a 7b batch-1 step 4.97 ->
    # 4.39 ms. It keeps every weight [out, in] (see `layers.Linear`), which cost batch-32 steps
    # 0.005 ms there (0.03-0.05 ms in an earlier measurement of the in-major storage).
    triton_gemv: bool | None = None
    # The batch-1 output projection (self_attn.dense) alone through that GEMV, on a GPU, with the
    # rest on cuBLAS: 11.2 us against cuBLAS's 13.9 (a split-K GEMV plus its reduce kernel) on the
    # H200 (benchmarks/linear/bench_gemv.py). The other three linears stay faster on cuBLAS.
    gemv_o_proj: bool = True

    def __post_init__(self) -> None:
        device = self.device
        if isinstance(device, str):
            try:
                device = torch.device(device)
            except RuntimeError as exc:
                raise InputError(f"ModelOptions.device {self.device!r} is not a device: {exc}") from None
        if not isinstance(device, torch.device):
            raise InputError(f"ModelOptions.device must be a torch.device or str, got {self.device!r}")
        object.__setattr__(self, "device", device)
        if self.dtype not in DTYPES:
            raise InputError(f"ModelOptions.dtype must be one of {DTYPES}, got {self.dtype!r}")
        for name in ("force_dense", "triton_gemv", "gemv_o_proj"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "triton_gemv" and value is None):
                raise InputError(f"ModelOptions.{name} must be a bool, got {value!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise InputError(
                f"ModelOptions.attn_impl must be one of {tuple(ATTN_IMPLS)}, got {self.attn_impl!r}"
            )
        ids = self.dummy_token_indices
        if not isinstance(ids, (tuple, list)) or any(
            isinstance(i, bool) or not isinstance(i, int) for i in ids
        ):
            raise InputError(f"ModelOptions.dummy_token_indices must be a tuple of ints, got {ids!r}")
        object.__setattr__(self, "dummy_token_indices", tuple(ids))

    @property
    def gemv_on(self) -> bool:
        """`triton_gemv`, with None meaning: on for a CUDA device, unless the model is the
        plain-PyTorch reference (attn_impl="reference")."""
        if self.triton_gemv is None:
            return self.device.type == "cuda" and self.attn_impl != "reference"
        return self.triton_gemv

    @property
    def attn_impls(self) -> tuple[str | None, str | None]:
        """(prefill impl, decode impl) for sparsegen.prefill / sparsegen.paged_decode."""
        return ATTN_IMPLS[self.attn_impl]

    @classmethod
    def of(cls, options: ModelOptions | None = None, **overrides) -> ModelOptions:
        """`options` (default: all defaults) with any of its fields replaced by keywords."""
        if options is not None and not isinstance(options, ModelOptions):
            raise InputError(f"options must be a ModelOptions, got {type(options).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise InputError(f"unknown model options {unknown}; ModelOptions has {sorted(known)}")
        overrides = {k: v for k, v in overrides.items() if v is not None or k == "attn_impl"}
        return replace(options or cls(), **overrides)
