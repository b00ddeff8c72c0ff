"""Triton builds in worker processes (sparsegen.jit.build_workers): the same files as a build in
this process, errors and dead workers reported as CompileError, the context reaching threads."""

from __future__ import annotations

import contextvars
import os
import threading
from pathlib import Path

import pytest
import torch

from sparsegen.errors import CompileError
from sparsegen.jit import build_workers, triton_build

SOURCE = """
import triton
import triton.language as tl


@triton.jit
def add_one(X, Y, n):
    i = tl.program_id(0) * 128 + tl.arange(0, 128)
    tl.store(Y + i, tl.load(X + i, mask=i < n) + 1.0, mask=i < n)
"""
JOB = dict(fn_name="add_one", signature={"X": "*fp32", "Y": "*fp32", "n": "i32"}, aligned=("X", "Y"),
           arch="sm_90", options={"num_warps": 4}, module_name="sg_test_add_one", source_file="kernel.py")  # fmt: skip


def code_lines(ptx: bytes) -> list[str]:
    """PTX without its debug sections (they hold the build's temporary path)."""
    text = ptx.decode()
    return [ln for ln in text.split(".section")[0].splitlines() if ".file" not in ln]


def test_a_worker_builds_what_this_process_builds():
    here = triton_build.compile_in_process(
        {**JOB, "source": SOURCE, "aligned": list(JOB["aligned"]), "ast_source": None}
    )
    with build_workers.BuildWorkers(1) as workers, build_workers.using(workers):
        there = triton_build.aot_compile(SOURCE, **JOB)
    assert sorted(there) == sorted(here)
    ptx = next(n for n in here if n.endswith(".ptx"))
    assert code_lines(there[ptx]) == code_lines(here[ptx]) and "add_one" in there[ptx].decode()


def test_a_failed_build_in_a_worker_is_a_compile_error_and_the_worker_is_reused():
    bad = SOURCE.replace("+ 1.0", "+ undefined_name")
    with build_workers.BuildWorkers(1) as workers, build_workers.using(workers):
        with pytest.raises(CompileError, match="add_one"):
            triton_build.aot_compile(bad, **JOB)
        assert len(workers._all) == 1  # the worker answered, so it stays
        assert any(n.endswith(".cubin") for n in triton_build.aot_compile(SOURCE, **JOB))
        assert len(workers._all) == 1


def test_a_dead_worker_is_a_compile_error_naming_its_status(monkeypatch):
    monkeypatch.setattr(build_workers, "WORKER_CODE", "import sys; sys.stderr.write('boom'); sys.exit(3)")
    with build_workers.BuildWorkers(1) as workers:
        with pytest.raises(CompileError, match=r"status 3: boom"):
            workers.compile({"source": ""})
        assert workers._all == []  # never reused


def test_the_workers_reach_threads_run_in_a_copied_context():
    assert build_workers.current() is None
    seen = []
    with build_workers.BuildWorkers(1) as workers, build_workers.using(workers):
        ctx = contextvars.copy_context()
        t = threading.Thread(target=lambda: seen.append(ctx.run(build_workers.current)))
        t.start()
        t.join()
        plain = threading.Thread(target=lambda: seen.append(build_workers.current()))  # a fresh context
        plain.start()
        plain.join()
    assert seen == [workers, None] and build_workers.current() is None


def test_bad_worker_count_is_refused():
    with pytest.raises(ValueError, match="n >= 1"):
        build_workers.BuildWorkers(0)


def test_workers_import_this_sparsegen_from_any_directory(tmp_path, monkeypatch):
    import sparsegen

    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.chdir(tmp_path)  # neither the cwd nor PYTHONPATH leads to the source tree
    env = build_workers.worker_env()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(Path(sparsegen.__file__).resolve().parents[1])
    with build_workers.BuildWorkers(1) as workers, build_workers.using(workers):
        assert any(n.endswith(".cubin") for n in triton_build.aot_compile(SOURCE, **JOB))


def test_without_a_worker_process_the_build_runs_here(monkeypatch):
    monkeypatch.setattr(build_workers.sys, "executable", "/nonexistent/python")
    with build_workers.BuildWorkers(2) as workers, build_workers.using(workers.start()):
        assert workers._all == []  # neither could start
        assert any(n.endswith(".cubin") for n in triton_build.aot_compile(SOURCE, **JOB))


@pytest.mark.parametrize("tl", [False, True])  # the default (Gluon on sm_90) and the tl variant
def test_precompile_builds_each_kernel_once_into_the_cache(fresh_cache, monkeypatch, tl):
    if tl:
        monkeypatch.setenv("SPARSEGEN_PREFILL_TL", "1")
    from sparsegen.kernels import base
    from sparsegen.kernels.prefill import precompile
    from sparsegen.spec import HeadSpec, LayerSpec

    a = LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(local_blocks=2),) * 2)
    b = LayerSpec(num_heads=2, num_kv_heads=2, head_dim=64, heads=(HeadSpec(sliding_window=100),) * 2)
    keys = precompile([a, b, a], (torch.float16,), arch="sm_90")  # the repeat is built once
    assert len(keys) == 2 and len(set(keys)) == 2
    for layer, key in zip((a, b), keys, strict=True):
        found = base.get("prefill", layer, dtype=torch.float16, arch="sm_90", with_status=True)
        assert found.kernel.key == key and found.status in ("cached", "memory")
        assert any(found.kernel.path.glob("*.cubin"))  # the build is in the disk cache
        assert found.kernel.request.variant == ("tl" if tl else "gluon")
