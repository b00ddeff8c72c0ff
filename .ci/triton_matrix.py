"""CI: build every phi3small kernel ahead of time with each tested Triton, for sm_80 and sm_90.

    python .ci/triton_matrix.py [--cache DIR] [--versions 3.8.0 3.9.0]

For each release in `sparsegen.jit.triton_support.TESTED`, the Triton already installed is used
when it is that release; any other gets a venv layered over this Python's packages
(`--system-site-packages`, so the CI torch is shared) under the cache folder
(`$SPARSEGEN_CI_CACHE`, else ~/.cache/sparsegen-ci), made once and reused by later runs. The
kernels themselves are built cold on every run (a fresh kernel cache and Triton cache each), in
three builds per release:

    sm_80      `sparsegen compile --pattern phi3small --arch sm_80`: tl prefill + CUDA decode
    sm_90      the same for sm_90: the Gluon prefill + CUDA decode
    sm_90 tl   SPARSEGEN_PREFILL_TL=1, prefill only: the tl prefill for sm_90 (Gluon's fallback)

`--model-kernels` is added when this tree's `compile` has it. A build passes when every kernel
compiled, the sm_90 prefill is the Gluon kernel (not a fallback), and its PTX overlaps the
softmax with the tensor cores (`wgmma.wait_group` N >= 1). Prints one table row per kernel and
exits 1 if anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from sparsegen.jit import triton_support  # noqa: E402 - after the tree is on the path

BUILDS = (  # (label, compile arguments, extra environment)
    ("sm_80", ["--arch", "sm_80"], {}),
    ("sm_90", ["--arch", "sm_90"], {}),
    ("sm_90 tl", ["--arch", "sm_90", "--kind", "prefill"], {"SPARSEGEN_PREFILL_TL": "1"}),
)
WAIT = re.compile(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)")


def cache_root(given: str | None) -> Path:
    base = given or os.environ.get("SPARSEGEN_CI_CACHE")
    if base:
        return Path(base)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sparsegen-ci"


def python_for(version: str, root: Path) -> str:
    """A Python whose Triton is `version`: this one, or a cached venv over this one's packages."""
    if triton_support.installed() == version:
        return sys.executable
    venv = root / f"triton-{version}"
    python, done = venv / "bin" / "python", venv / ".sparsegen-ready"
    if not done.exists():  # absent, or a run stopped half-way through making it
        print(f"ci: making a venv with triton=={version} in {venv}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(venv)], check=True
        )
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        f"triton=={version}"], check=True)  # fmt: skip
        done.write_text(version + "\n")
    return str(python)


def has_model_kernels(python: str) -> bool:
    out = subprocess.run([python, "-m", "sparsegen", "compile", "--help"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)  # fmt: skip
    return "--model-kernels" in out.stdout


def waits(record: dict) -> str:
    """The wgmma.wait_group counts in a kernel's PTX ('0,1'), or '-' when it has none."""
    ptx = next(Path(record["path"]).glob("*.ptx"), None)
    found = sorted({int(n) for n in WAIT.findall(ptx.read_text())}) if ptx else []
    return ",".join(map(str, found)) or "-"


def check(label: str, record: dict) -> str:
    """'ok', or why the kernel fails the matrix."""
    if record["status"] != "compiled":
        return f"status {record['status']} (a cold build must compile)"
    if label == "sm_90" and record["kind"] == "prefill":
        if not record["name"].startswith("prefill_gluon"):
            return "the sm_90 prefill is not the Gluon kernel"
        found = waits(record)
        if found == "-" or max(int(n) for n in found.split(",")) < 1:
            return f"wgmma.wait_group {found}: softmax does not overlap the matmuls"
    return "ok"


def run_build(python: str, version: str, label: str, args: list[str], extra: dict, model: bool) -> list[list]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="sparsegen-matrix-") as tmp:
        cache = Path(tmp) / "kernels"
        cache.mkdir(mode=0o700)
        env = {**os.environ, **extra, "PYTHONPATH": str(ROOT), "SPARSEGEN_CACHE_DIR": str(cache),
               "TRITON_CACHE_DIR": str(Path(tmp) / "triton"), "SPARSEGEN_QUIET": "1"}  # fmt: skip
        cmd = [python, "-m", "sparsegen", "compile", "--pattern", "phi3small", "--json", *args]
        cmd += ["--model-kernels"] if model and label != "sm_90 tl" else []
        start = time.perf_counter()
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp, timeout=900)
        seconds = time.perf_counter() - start
        if res.returncode != 0:
            lines = [s for s in res.stderr.splitlines() if s.strip() and "nanobind" not in s]
            return [[version, label, "(compile)", f"FAILED: exit {res.returncode}: {' | '.join(lines[-3:])}",
                     "-", f"{seconds:.1f}"]]  # fmt: skip
        for record in json.loads(res.stdout):
            result = check(label, record)
            rows.append([version, label, record["name"], result, waits(record), f"{record['seconds']:.1f}"])
        rows.append([version, label, "(build)", "ok", "-", f"{seconds:.1f}"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache", help="where the venvs are kept (default $SPARSEGEN_CI_CACHE or ~/.cache/sparsegen-ci)"
    )
    parser.add_argument("--versions", nargs="+", default=list(triton_support.TESTED))
    opts = parser.parse_args()
    root = cache_root(opts.cache)
    root.mkdir(parents=True, exist_ok=True)
    rows, start = [], time.perf_counter()
    for version in opts.versions:
        t0 = time.perf_counter()
        try:
            python = python_for(version, root)
        except subprocess.CalledProcessError as exc:
            rows.append([version, "-", "(venv)", f"FAILED: {exc}", "-", f"{time.perf_counter() - t0:.1f}"])
            continue
        model = has_model_kernels(python)
        for label, args, extra in BUILDS:
            rows += run_build(python, version, label, args, extra, model)
        print(f"ci: triton {version}: {time.perf_counter() - t0:.1f} s", flush=True)
    header = ["triton", "build", "kernel", "result", "wait_group", "seconds"]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    failed = [r for r in rows if r[3] != "ok"]
    print(f"ci: triton matrix: {len(rows) - len(failed)} ok, {len(failed)} failed, "
          f"{time.perf_counter() - start:.1f} s")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
