"""`sparsegen fuzz` reports progress with its bar (on a terminal) and its own lines, not with a
"compiling ..." / "compiled ..." pair per interpreter build."""

from __future__ import annotations

from helpers.interpreter import run_in_interpreter


def test_fuzz_stderr_has_no_line_per_build(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)  # cold: every spec's kernel is built in this run
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(cache))
    monkeypatch.delenv("SPARSEGEN_LOG_LEVEL", raising=False)
    run = run_in_interpreter(
        "-c",
        "import os, sys; os.environ.pop('SPARSEGEN_QUIET'); from sparsegen.cli import main; sys.argv[0] = 'sparsegen'; main()",
        "fuzz", "--random", "--specs", "3", "--examples", "1", "--max-len", "40", "--seed", "5",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "prefill: 3 cases over 3 spec(s), 0 failed" in run.stdout
    lines = run.stderr.splitlines()
    assert len(lines) == 2, lines  # what is fuzzed, and how to rerun it
    assert lines[0].startswith("sparsegen: fuzzing prefill") and "--seed 5" in lines[1], lines
    assert any(p.name.startswith("prefill_") for p in cache.iterdir()), "nothing was built"
