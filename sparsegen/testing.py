"""Hypothesis strategies for fuzzing patterns, plus the comparisons the kernel tests use.

    from hypothesis import given
    from sparsegen.testing import layer_specs, prefill_problems

    @given(prefill_problems(layer_specs(hybrid=True)))
    def test_mine(problem):
        out = my_kernel(*problem.args())
        assert_close_rows(out, problem.reference(), context=problem.repro())

Strategies draw *descriptions* (specs, lengths, a seed); tensors are then made from the seed
with `torch.Generator`, on the device asked for, from random normal data (never zeros).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import MissingExtraError

try:
    from hypothesis import strategies as st
except ImportError as _exc:
    raise MissingExtraError(
        f"sparsegen.testing needs hypothesis ({_exc}): pip install 'sparsegen[fuzz]'"
    ) from None

from . import reference
from .spec import SUPPORTED_HEAD_DIMS, HeadSpec, LayerSpec

BLOCK_SIZES = (16, 32, 64, 128)
PAGE_SIZES = (8, 16, 32, 64, 128)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; any NaN or inf in `out` gives inf, so it never passes."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference shape {tuple(ref64.shape)}")
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


# Per-row tolerance of a kernel's output against the float64 oracle, by the kernel's dtype. A
# half-precision kernel rounds P before P.V and rounds its output, each within half an ulp, with
# float32 sums: its worst (row, head) lands near 0.4 eps (fp16 in the interpreter: 3.9e-4 over
# 2,000 rows; the float64 reference rounded to fp16 alone is 2.7e-4), so 4 eps leaves ~10x room.
# float32 kernels sum over hundreds of tiles (worst row 4e-7 measured), so they get a floor.
ROW_TOL = {
    torch.float16: 4 * torch.finfo(torch.float16).eps,  # 3.9e-3
    torch.bfloat16: 4 * torch.finfo(torch.bfloat16).eps,  # 3.1e-2
    torch.float32: 1e-5,
}


def row_errors(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Relative error of every row (all dims but the last: (token, head) for attention outputs),
    in float64: ||out_row - ref_row|| / max(||ref_row||, floor); a row holding NaN or inf gives inf.
    The floor is what `out`'s dtype can hold to its relative precision: sqrt(D) times its smallest
    normal number (fp16: 6.1e-5). A row whose reference lies below it (an fp16 output that strong
    learned sinks shrink to ~1e-5, say) is stored in subnormals, which carry fewer bits, so it is
    judged by its error relative to that floor instead."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape:
        raise AssertionError(f"shape {tuple(out64.shape)} != reference shape {tuple(ref64.shape)}")
    tiny = torch.finfo(out.dtype).tiny if out.dtype.is_floating_point else 0.0
    floor = max(tiny * out64.shape[-1] ** 0.5, 1e-30)
    err = (out64 - ref64).norm(dim=-1) / ref64.norm(dim=-1).clamp_min(floor)
    return err.masked_fill(~torch.isfinite(out64).all(dim=-1), float("inf"))


def row_mismatch(
    out: torch.Tensor, ref: torch.Tensor, *, dtype: torch.dtype | None = None, tol: float | None = None
) -> str | None:
    """None when every (row, head) of `out` is within the per-row tolerance of `ref` (ROW_TOL of
    `dtype`, default out's dtype, unless `tol` is given), else what is wrong, naming the worst rows
    by index so that a bug confined to one tile, head or page shows where it is. NaN never passes."""
    limit = tol if tol is not None else ROW_TOL[dtype or out.dtype]
    err = row_errors(out, ref)
    bad = ~(err <= limit) | ~torch.isfinite(err)  # NaN or inf fails under any tolerance
    if not bad.any():
        return None
    flat = err.flatten().nan_to_num(nan=float("inf"), posinf=float("inf"))
    worst = flat.masked_fill(~bad.flatten(), -1.0).topk(min(5, int(bad.sum()))).indices
    where = ", ".join(
        f"{tuple(int(i) for i in torch.unravel_index(j, err.shape))}: {float(flat[j]):.3g}" for j in worst
    )
    return (
        f"{int(bad.sum())} of {err.numel()} rows over the per-row tolerance {limit:.3g} "
        f"(global rel err {rel_err(out, ref):.3g}); worst rows {where}"
    )


def assert_close_rows(
    out: torch.Tensor,
    ref: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    tol: float | None = None,
    context: str = "",
) -> None:
    """Raise AssertionError with `row_mismatch`'s account (and `context`, e.g. a repro) unless every
    (row, head) of `out` is within the per-row tolerance of `ref`."""
    wrong = row_mismatch(out, ref, dtype=dtype, tol=tol)
    if wrong is not None:
        raise AssertionError(wrong + (f"; {context}" if context else ""))


HEAD_KINDS = ("dense", "local", "local+vert", "window", "local+window", "vert+window", "local+vert+window")


def sample_head_spec(rng, *, windows: tuple[int, ...] | None = None, max_window: int = 700) -> HeadSpec:
    """A random valid HeadSpec from a `random.Random`, for GPU tests that bound how many
    distinct specs (and so compiles) they draw. Windows come from `windows`, else 1..max_window."""
    bs = rng.choice(BLOCK_SIZES)
    kind = rng.choice(HEAD_KINDS)
    if kind == "dense":
        return HeadSpec(block_size=bs, dense=True)
    stride = rng.randint(1, 8) if "vert" in kind else 0
    return HeadSpec(
        block_size=bs,
        local_blocks=rng.randint(1, 6) if "local" in kind else 0,
        vert_stride=stride,
        vert_offset=rng.randint(0, stride - 1) if stride else 0,
        sliding_window=(rng.choice(windows) if windows else rng.randint(1, max_window))
        if "window" in kind
        else 0,
    )


def sample_layer_spec(
    rng,
    *,
    hybrid: bool,
    head_dims: tuple[int, ...] = (64, 96, 128),
    ratios: tuple[int, ...] = (1, 2, 3, 4, 8),
    max_kv_heads: int = 2,
    windows: tuple[int, ...] | None = None,
) -> LayerSpec:
    """A random valid LayerSpec from a `random.Random`: hybrid (every head its own pattern) or
    Phi-3 style (one pattern for all heads, vertical offsets varying by head)."""
    kv = rng.randint(1, max_kv_heads)
    heads_n = kv * rng.choice(ratios)
    d = rng.choice(head_dims)
    if hybrid:
        heads = tuple(sample_head_spec(rng, windows=windows) for _ in range(heads_n))
    else:
        base = sample_head_spec(rng, windows=windows)
        s = base.vert_stride
        heads = tuple(
            HeadSpec(**{**base.to_dict(), "vert_offset": h % s}) if s else base for h in range(heads_n)
        )
    return LayerSpec(num_heads=heads_n, num_kv_heads=kv, head_dim=d, heads=heads)


@st.composite
def head_specs(draw, block_size: int | None = None, kinds: tuple[str, ...] | None = None) -> HeadSpec:
    """A valid HeadSpec: dense, or any union of local blocks, vertical stride and window."""
    bs = block_size if block_size is not None else draw(st.sampled_from(BLOCK_SIZES))
    kind = draw(st.sampled_from(kinds or HEAD_KINDS))
    if kind == "dense":
        return HeadSpec(block_size=bs, dense=True)
    local = draw(st.integers(1, 6)) if "local" in kind else 0
    stride = draw(st.integers(1, 8)) if "vert" in kind else 0
    offset = draw(st.integers(0, stride - 1)) if stride else 0
    window = draw(st.integers(1, 400)) if "window" in kind else 0
    return HeadSpec(
        block_size=bs, local_blocks=local, vert_stride=stride, vert_offset=offset, sliding_window=window
    )


@st.composite
def layer_specs(
    draw,
    head_dims: tuple[int, ...] = SUPPORTED_HEAD_DIMS,
    max_kv_heads: int = 2,
    gqa_ratios: tuple[int, ...] = (1, 2, 4, 8),
    hybrid: bool = True,
    block_sizes: tuple[int, ...] = BLOCK_SIZES,
) -> LayerSpec:
    """A valid LayerSpec. hybrid=True mixes head kinds within the layer; otherwise every head
    has one kind and block size, and only the vertical offsets vary (Phi-3-Small style)."""
    num_kv = draw(st.integers(1, max_kv_heads))
    num_heads = num_kv * draw(st.sampled_from(gqa_ratios))
    head_dim = draw(st.sampled_from(head_dims))
    if hybrid:
        heads = tuple(
            draw(head_specs(block_size=draw(st.sampled_from(block_sizes)))) for _ in range(num_heads)
        )
    else:
        base = draw(head_specs(block_size=draw(st.sampled_from(block_sizes))))
        if base.vert_stride:
            heads = tuple(
                HeadSpec(**{**base.to_dict(), "vert_offset": h % base.vert_stride}) for h in range(num_heads)
            )
        else:
            heads = (base,) * num_heads
    return LayerSpec(num_heads=num_heads, num_kv_heads=num_kv, head_dim=head_dim, heads=heads)


WIDE_BLOCK_SIZES = (*BLOCK_SIZES, 256)


def wide_layer_specs(head_dims: tuple[int, ...] = SUPPORTED_HEAD_DIMS, hybrid: bool = True):
    """`layer_specs` over the wider region: block size 256 too, 1..8 KV heads and group sizes
    1..8 (so up to 64 query heads)."""
    return layer_specs(
        head_dims=head_dims,
        max_kv_heads=8,
        gqa_ratios=tuple(range(1, 9)),
        hybrid=hybrid,
        block_sizes=WIDE_BLOCK_SIZES,
    )


def _randn(shape, gen: torch.Generator, dtype: torch.dtype, device) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype=dtype, device=device)


@dataclass
class PrefillProblem:
    layer: LayerSpec
    q_lens: list[int]
    k_lens: list[int]
    seed: int
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    scale: float | None = None
    tensors: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        h, hkv, d = self.layer.num_heads, self.layer.num_kv_heads, self.layer.head_dim
        tq, tk = sum(self.q_lens), sum(self.k_lens)
        self.tensors = {
            "q": _randn((tq, h, d), gen, self.dtype, self.device),
            "k": _randn((tk, hkv, d), gen, self.dtype, self.device),
            "v": _randn((tk, hkv, d), gen, self.dtype, self.device),
            "cu_seqlens_q": _offsets(self.q_lens, self.device),
            "cu_seqlens_k": _offsets(self.k_lens, self.device),
        }

    def args(self) -> tuple:
        t = self.tensors
        return (t["q"], t["k"], t["v"], t["cu_seqlens_q"], t["cu_seqlens_k"], self.layer, self.scale)

    def reference(self, *, exact: bool = True) -> torch.Tensor:
        """The oracle's answer: float64 math on the CPU, or (exact=False) float32 math where the
        tensors are, which is far quicker on a GPU for long sequences."""
        return reference.prefill(*_oracle_args(self.args(), exact))

    def repro(self) -> str:
        return (
            f"PrefillProblem(layer=LayerSpec.from_json({self.layer.to_json()!r}), q_lens={self.q_lens}, "
            f"k_lens={self.k_lens}, seed={self.seed}, dtype={self.dtype}, scale={self.scale})"
        )


def _oracle_args(args: tuple, exact: bool) -> tuple:
    """Float tensors as float64 on the CPU (exact) or float32 in place; the rest unchanged
    (index tensors move to the CPU with them)."""

    def convert(x):
        if not isinstance(x, torch.Tensor):
            return x
        if exact:
            return x.cpu().double() if x.is_floating_point() else x.cpu()
        return x.float() if x.is_floating_point() else x

    return tuple(convert(x) for x in args)


def _offsets(lens: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


@st.composite
def prefill_problems(
    draw,
    layers=None,
    max_batch: int = 3,
    max_len: int = 300,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
    empty: bool = False,
    large_logits: bool = False,
) -> PrefillProblem:
    """A varlen batch: each sequence has k_len keys and its last q_len positions as queries
    (q_len < k_len models a cached prefix or a later chunk). `empty` also draws sequences with
    q_len 0 or k_len 0 among non-empty ones; `large_logits` draws softmax scales of 1..3, so that
    with unit-normal q and k the scores reach about +-50..100 before the softmax."""
    layer = draw(layers if layers is not None else layer_specs())
    batch = draw(st.integers(1, max_batch))
    k_lens = [draw(st.integers(1, max_len)) for _ in range(batch)]
    q_lens = [draw(st.one_of(st.just(n), st.integers(1, n))) for n in k_lens]
    if empty and batch > 1:  # empty sequences inside a varlen batch (the kernels allow them)
        for b in draw(st.sets(st.integers(0, batch - 1), max_size=batch - 1)):
            k_lens[b] = draw(st.sampled_from((0, k_lens[b])))
            q_lens[b] = 0 if k_lens[b] == 0 else draw(st.sampled_from((0, q_lens[b])))
    seed = draw(st.integers(0, 2**31 - 1))
    scales = st.floats(1.0, 3.0) if large_logits else st.floats(0.01, 0.2)
    scale = draw(scales if large_logits else st.one_of(st.none(), scales))
    return PrefillProblem(layer, q_lens, k_lens, seed, dtype, device, scale)


@dataclass
class DecodeProblem:
    layer: LayerSpec
    seq_lens: list[int]
    page_size: int
    seed: int
    dtype: torch.dtype = torch.float16
    device: str = "cpu"
    scale: float | None = None
    spare_pages: int = 3
    tensors: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        gen = torch.Generator().manual_seed(self.seed)
        h, hkv, d = self.layer.num_heads, self.layer.num_kv_heads, self.layer.head_dim
        pages_per_seq = [-(-n // self.page_size) for n in self.seq_lens]
        num_pages = sum(pages_per_seq) + self.spare_pages
        max_pages = max(pages_per_seq) + 1
        # Shuffled page ids: sequences own scattered, non-contiguous pages.
        perm = torch.randperm(num_pages, generator=gen)
        tables = torch.full((len(self.seq_lens), max_pages), -1, dtype=torch.int32)
        at = 0
        for b, n in enumerate(pages_per_seq):
            tables[b, :n] = perm[at : at + n].to(torch.int32)
            at += n
        self.tensors = {
            "q": _randn((len(self.seq_lens), h, d), gen, self.dtype, self.device),
            "k_cache": _randn((num_pages, self.page_size, hkv, d), gen, self.dtype, self.device),
            "v_cache": _randn((num_pages, self.page_size, hkv, d), gen, self.dtype, self.device),
            "block_tables": tables.to(self.device),
            "seq_lens": torch.tensor(self.seq_lens, dtype=torch.int32, device=self.device),
        }

    def args(self) -> tuple:
        t = self.tensors
        return (t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"], self.layer, self.scale)

    def reference(self, *, exact: bool = True) -> torch.Tensor:
        """The oracle's answer: float64 math on the CPU, or (exact=False) float32 math where the
        tensors are, which is far quicker on a GPU for long sequences."""
        return reference.paged_decode(*_oracle_args(self.args(), exact))

    def as_prefill(self, b: int = 0, seed: int = 0) -> tuple:
        """Sequence b as a prefill whose last query row is its decode query (the metamorphic
        check: prefill's last row equals decode): (q, k, v, cu_seqlens, cu_seqlens) with
        q: [n, H, D] random but for row n - 1, k/v: [n, Hkv, D] gathered from its pages."""
        t, n = self.tensors, self.seq_lens[b]
        pages = t["block_tables"][b, : -(-n // self.page_size)].long()
        k = t["k_cache"][pages].flatten(0, 1)[:n]  # [n, Hkv, D]
        v = t["v_cache"][pages].flatten(0, 1)[:n]
        gen = torch.Generator().manual_seed(seed)
        q = _randn((n, self.layer.num_heads, self.layer.head_dim), gen, self.dtype, self.device)
        q[-1] = t["q"][b]
        cu = torch.tensor([0, n], dtype=torch.int32, device=self.device)
        return q, k, v, cu, cu

    def repro(self) -> str:
        return (
            f"DecodeProblem(layer=LayerSpec.from_json({self.layer.to_json()!r}), seq_lens={self.seq_lens}, "
            f"page_size={self.page_size}, seed={self.seed}, dtype={self.dtype}, scale={self.scale})"
        )


@st.composite
def decode_problems(
    draw,
    layers=None,
    max_batch: int = 4,
    max_len: int = 2000,
    page_sizes: tuple[int, ...] = PAGE_SIZES,
    dtype: torch.dtype = torch.float16,
    device: str = "cpu",
) -> DecodeProblem:
    """A decode batch over a shuffled paged cache; lengths include 1 and non-multiples of anything."""
    layer = draw(layers if layers is not None else layer_specs())
    batch = draw(st.integers(1, max_batch))
    seq_lens = [draw(st.one_of(st.just(1), st.integers(1, max_len))) for _ in range(batch)]
    page_size = draw(st.sampled_from(page_sizes))
    seed = draw(st.integers(0, 2**31 - 1))
    scale = draw(st.one_of(st.none(), st.floats(0.01, 0.2)))
    return DecodeProblem(layer, seq_lens, page_size, seed, dtype, device, scale)
