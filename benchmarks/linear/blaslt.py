"""cuBLASLt linears with a measured algorithm choice (GPU only), through ctypes.

`F.linear` asks cuBLAS(Lt) for its heuristic's first algorithm. For the decode step's skinny
GEMMs (1-32 rows against 16-235 MB weights) that choice runs 3-5 us over the weight-read floor
per call (benchmarks/results/HISTORY.md, "Where a batch-1 decode step goes"); cuBLASLt's
heuristic returns a ranked list of candidates, and `LtLinear.tune` times each of them inside a
CUDA graph (the way the decode step runs) and keeps the fastest.

One `LtLinear` is one problem: rows M, weight [N, K] (or its transposed storage [K, N]), dtype,
bias or not. Column-major cuBLASLt sees the row-major product y[M, N] = x[M, K] @ W[N, K]^T as
Y^T[N, M] = op(A) @ X^T with A = W's memory (A^T for [N, K] rows, A as is for [K, N] rows), and
the bias as the epilogue's per-row vector of Y^T.

The library is the libcublasLt that torch has loaded into this process (found in
/proc/self/maps), so the versions match torch's own calls. Nothing here runs on a CPU machine
except the layout arithmetic (`lt_layouts`), which the CPU tests check.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass

import torch

from sparsegen.errors import InputError

# cublasLt.h / library_types.h values
_COMPUTE_32F = 68
_R_32F, _R_16F, _R_16BF = 0, 2, 14
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE_BYTES = 1
_DTYPES = {torch.bfloat16: _R_16BF, torch.float16: _R_16F}

WORKSPACE_BYTES = 32 << 20  # one buffer per device, shared by every call on its stream
MAX_ALGOS = 32


class _Algo(ctypes.Structure):  # cublasLtMatmulAlgo_t
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):  # cublasLtMatmulHeuristicResult_t
    _fields_ = [
        ("algo", _Algo),
        ("workspace_size", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("waves_count", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


@dataclass(frozen=True)
class LtLayouts:
    """The column-major operands of one linear: (rows, cols, ld) of A, B and D, and op(A)."""

    trans_a: int
    a: tuple[int, int, int]
    b: tuple[int, int, int]
    d: tuple[int, int, int]


def lt_layouts(m: int, n: int, k: int, *, in_major: bool) -> LtLayouts:
    """y[M, N] = x[M, K] @ W^T with W stored [N, K] (in_major=False) or [K, N] (True)."""
    if min(m, n, k) < 1:
        raise InputError(f"LtLinear needs positive sizes, got M={m} N={n} K={k}")
    a = (n, k, n) if in_major else (k, n, k)  # W's memory, column-major
    return LtLayouts(_OP_N if in_major else _OP_T, a, (k, m, k), (n, m, n))


@functools.lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    torch.cuda.init()  # torch's CUDA libraries are loaded by now
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcublasLt.so" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        pass
    path = path or ctypes.util.find_library("cublasLt")
    if path is None:
        raise RuntimeError("libcublasLt is not loaded in this process and was not found")
    lib = ctypes.CDLL(path)
    vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    signatures = {  # every argument typed: a bare Python int would be passed as a 32-bit int
        "cublasLtCreate": (vp,),
        "cublasLtMatmulDescCreate": (vp, i32, i32),
        "cublasLtMatmulDescSetAttribute": (vp, i32, vp, sz),
        "cublasLtMatrixLayoutCreate": (vp, i32, u64, u64, i64),
        "cublasLtMatmulPreferenceCreate": (vp,),
        "cublasLtMatmulPreferenceSetAttribute": (vp, i32, vp, sz),
        "cublasLtMatmulAlgoGetHeuristic": (vp, vp, vp, vp, vp, vp, vp, i32, vp, vp),
        "cublasLtMatmul": (vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp),
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cublasStatus {status}")


@functools.cache
def _handle(device_index: int) -> ctypes.c_void_p:
    h = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_lib().cublasLtCreate(ctypes.byref(h)), "cublasLtCreate")
    return h


@functools.cache
def _workspace(device_index: int) -> torch.Tensor:
    return torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{device_index}")


class LtLinear:
    """y = x @ W^T (+ b) for one (M, N, K, storage, dtype, bias) on one device."""

    def __init__(self, m: int, n: int, k: int, *, dtype: torch.dtype, bias: bool, in_major: bool, device):
        if dtype not in _DTYPES:
            raise InputError(f"LtLinear takes bfloat16 or float16, got {dtype}")
        self.m, self.n, self.k, self.dtype, self.bias, self.in_major = m, n, k, dtype, bias, in_major
        self.device = torch.device(device)
        lib, dt = _lib(), _DTYPES[dtype]
        lay = lt_layouts(m, n, k, in_major=in_major)
        self._desc = ctypes.c_void_p()
        _check(
            lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _R_32F), "MatmulDescCreate"
        )
        self._set(_DESC_TRANSA, ctypes.c_int32(lay.trans_a))
        self._set(_DESC_TRANSB, ctypes.c_int32(_OP_N))
        self._set(_DESC_EPILOGUE, ctypes.c_int32(_EPILOGUE_BIAS if bias else _EPILOGUE_DEFAULT))
        self._layouts = []
        for rows, cols, ld in (lay.a, lay.b, lay.d):
            h = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), dt, rows, cols, ld), "MatrixLayoutCreate")
            self._layouts.append(h)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        _check(
            lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
            "MatmulPreferenceSetAttribute",
        )
        results = (_Heuristic * MAX_ALGOS)()
        count = ctypes.c_int(0)
        a, b, d = self._layouts
        _check(
            lib.cublasLtMatmulAlgoGetHeuristic(
                _handle(self._index), self._desc, a, b, d, d, pref, MAX_ALGOS, results, ctypes.byref(count)
            ),
            "MatmulAlgoGetHeuristic",
        )
        self.algos = [results[i].algo for i in range(count.value) if results[i].state == 0]
        if not self.algos:
            raise RuntimeError(f"cuBLASLt has no algorithm for M={m} N={n} K={k} {dtype}")
        self.choice = 0  # the heuristic's first, as F.linear would take
        self.times_us: list[float] = []
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @property
    def _index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _set(self, attr: int, value) -> None:
        _check(
            _lib().cublasLtMatmulDescSetAttribute(
                self._desc, attr, ctypes.byref(value), ctypes.sizeof(value)
            ),
            "MatmulDescSetAttribute",
        )

    def __call__(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        out: torch.Tensor,
        algo: int | None = None,
    ) -> torch.Tensor:
        # x: [M, K] contiguous; w: [N, K] contiguous, or [K, N] contiguous if in_major; b: [N]; out: [M, N]
        if self.bias:
            self._set(_DESC_BIAS_POINTER, ctypes.c_void_p(b.data_ptr()))
        a, bl, d = self._layouts
        ws = _workspace(self._index)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        _check(
            _lib().cublasLtMatmul(
                _handle(self._index), self._desc, ctypes.byref(self._alpha),
                ctypes.c_void_p(w.data_ptr()), a, ctypes.c_void_p(x.data_ptr()), bl,
                ctypes.byref(self._beta), ctypes.c_void_p(out.data_ptr()), d,
                ctypes.c_void_p(out.data_ptr()), d,
                ctypes.byref(self.algos[self.choice if algo is None else algo]),
                ctypes.c_void_p(ws.data_ptr()), ctypes.c_size_t(WORKSPACE_BYTES), ctypes.c_void_p(stream),
            ),
            "cublasLtMatmul",
        )  # fmt: skip
        return out
