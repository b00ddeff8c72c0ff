"""The checks of .ci/triton_matrix.py (run by .ci/run with each tested Triton) can fail: a cached
kernel, a fallen-back sm_90 prefill or a PTX without overlap each fail the matrix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def matrix():
    spec = importlib.util.spec_from_file_location("triton_matrix", ROOT / ".ci" / "triton_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(tmp_path: Path, name: str, ptx: str | None, status: str = "compiled", kind: str = "prefill"):
    entry = tmp_path / name
    entry.mkdir()
    if ptx is not None:
        (entry / "prefill_kernel.ptx").write_text(ptx)
    return {"kind": kind, "name": name, "status": status, "path": str(entry), "seconds": 1.0}


def test_checks(matrix, tmp_path):
    overlap = "wgmma.wait_group.sync.aligned 1;\n wgmma.wait_group.sync.aligned  0;\n"
    serial = "wgmma.wait_group.sync.aligned 0;\n"
    good = _record(tmp_path, "prefill_gluon_a", overlap)
    assert matrix.check("sm_90", good) == "ok" and matrix.waits(good) == "0,1"
    assert "softmax does not overlap" in matrix.check("sm_90", _record(tmp_path, "prefill_gluon_b", serial))
    assert "not the Gluon kernel" in matrix.check("sm_90", _record(tmp_path, "prefill_bf16_c", overlap))
    assert "cold build" in matrix.check("sm_80", _record(tmp_path, "prefill_bf16_d", None, status="cached"))
    assert matrix.check("sm_80", _record(tmp_path, "decode_e", None, kind="decode")) == "ok"
    assert matrix.check("sm_90 tl", _record(tmp_path, "prefill_bf16_f", serial)) == "ok"
    assert matrix.cache_root("/x/y") == Path("/x/y")
