"""The wheel, installed the way a user installs it, into clean virtual environments.

A venv without system site-packages sees only the distributions sparsegen declares (for the
extras asked for) and, recursively, theirs. They are not downloaded: each is linked from this
machine's site-packages into the venv's, so the test is fast and works offline. pip then installs the wheel with `--no-index` and resolves its
requirements against exactly that set: a dependency missing from pyproject.toml makes either
pip or one of the commands below fail, as it would for a user.

- no extras: `compile --kind prefill` (Triton, ahead of time for sm_90) and `generate --random
  tiny` work; `fuzz` and `show --png` say which extra they need (exit 1, one line);
- the `cuda` extra: the full `compile` (NVRTC decode kernels too) works.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _requirements(dist_name: str, extras: set[str]) -> list[Requirement]:
    """`dist_name`'s requirements that apply here with `extras` on."""
    out = []
    for text in md.requires(dist_name) or []:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
            out.append(req)
    return out


def closure(requirements: list[Requirement]) -> dict[str, md.Distribution]:
    """Every installed distribution the requirements reach (by canonical name); fails on one that
    this machine does not have, or at a version the requirement excludes."""
    seen: dict[str, md.Distribution] = {}
    todo = list(requirements)
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name == "sparsegen":  # a self-reference such as cuda = ["sparsegen[cu13]"]
            todo += _pyproject_requirements(req.extras)
            continue
        if name in seen and not req.extras:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.fail(f"{req} is required but not installed on this machine")
        assert req.specifier.contains(dist.version, prereleases=True), f"{req} vs installed {dist.version}"
        first = name not in seen
        seen[name] = dist
        if first or req.extras:
            todo += _requirements(dist.metadata["Name"], set(req.extras))
    return seen


def _pyproject_requirements(extras) -> list[Requirement]:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        reqs += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return reqs


def link_distributions(dists: dict[str, md.Distribution], into: Path) -> None:
    """Symlink each distribution's installed files into `into`, one level below namespace
    packages (`cuda/`, `nvidia/` hold several distributions), so only these are importable."""
    for dist in dists.values():
        base = Path(dist.locate_file(""))
        tops = set()
        for f in dist.files or []:
            parts = Path(f).parts
            if not parts or parts[0] == ".." or parts[0].endswith(".data"):
                continue  # scripts outside site-packages
            namespace = not parts[0].endswith(".dist-info") and not (base / parts[0] / "__init__.py").exists()
            if len(parts) > 2 and namespace:
                tops.add(Path(parts[0], parts[1]))  # a namespace package
            else:
                tops.add(Path(parts[0]))
        for top in tops:
            if top.name == "__pycache__" or not (base / top).exists():
                continue
            target = into / top
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.exists():
                target.symlink_to(base / top)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (found,) = out.glob("sparsegen-*.whl")
    return found


def make_venv(tmp: Path, wheel: Path, extras: tuple[str, ...]) -> Path:
    """A clean venv holding the wheel and exactly the distributions it declares for `extras`."""
    env_dir = tmp / "venv"
    venv.EnvBuilder(with_pip=False, system_site_packages=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # Linked into the venv's own site-packages: cuda-pathfinder looks for libnvrtc there.
    link_distributions(closure(_pyproject_requirements(extras)), Path(site))
    spec = f"{wheel}[{','.join(extras)}]" if extras else str(wheel)
    res = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index", spec],
        capture_output=True,
        text=True,
        env={**os.environ, "PIP_CONSTRAINT": "", "PIP_FIND_LINKS": ""},
    )
    assert res.returncode == 0, res.stderr
    return env_dir


def run_in(env_dir: Path, cache: Path, program: str, *args: str) -> subprocess.CompletedProcess:
    """`program` of the venv, with none of this session's PYTHONPATH, SPARSEGEN_* or TRITON_* set."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "SPARSEGEN_", "TRITON_", "VIRTUAL_ENV"))
    }
    env.update(SPARSEGEN_CACHE_DIR=str(cache), PYTHONNOUSERSITE="1")
    return subprocess.run(
        [str(env_dir / "bin" / program), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cache.parent,  # not the source tree
        timeout=300,
    )


def run_cli(env_dir: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    return run_in(env_dir, cache, "sparsegen", *args)


def _cache(tmp: Path) -> Path:
    cache = tmp / "cache"
    cache.mkdir(mode=0o700)
    return cache


def test_no_extras(wheel, tmp_path):
    env_dir = make_venv(tmp_path, wheel, ())
    cache = _cache(tmp_path)
    probe = (
        "import sparsegen, triton, importlib.util as u; print(sparsegen.__file__, u.find_spec('hypothesis'))"
    )
    where = run_in(env_dir, cache, "python", "-c", probe)
    # the wheel's copy, and only the core set (hypothesis is on this machine, but not in the venv)
    assert where.stdout.startswith(str(env_dir)) and where.stdout.split()[1] == "None", where
    res = run_cli(env_dir, cache, "compile", "--pattern", "phi3small", "--kind", "prefill", "--json")
    assert res.returncode == 0, res.stderr
    records = json.loads(res.stdout)
    assert [r["status"] for r in records] == ["compiled", "compiled"]
    assert all(r["arch"] == "sm_90" and Path(r["path"]).is_relative_to(cache) for r in records)
    res = run_cli(env_dir, cache, "generate", "--random", "tiny", "--prompt-ids", "1,2,3", "--max-tokens", "3",
                  "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["prompt_ids"] == [1, 2, 3]
    for args, extra in ((("fuzz", "--random", "--specs", "1"), "sparsegen[fuzz]"),
                        (("show", "--pattern", "phi3small", "--png", str(tmp_path / "x.png")), "sparsegen[plot]")):  # fmt: skip
        res = run_cli(env_dir, cache, *args)
        assert res.returncode == 1, (args, res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and extra in lines[0] and "Traceback" not in res.stderr, res.stderr
        assert res.stdout == ""


def test_cuda_extra_compiles_everything(wheel, tmp_path):
    env_dir = make_venv(tmp_path, wheel, ("cuda",))
    cache = _cache(tmp_path)
    res = run_cli(env_dir, cache, "compile", "--pattern", "phi3small", "--json")
    assert res.returncode == 0, res.stderr
    records = json.loads(res.stdout)
    assert sorted(r["kind"] for r in records) == ["decode", "decode", "prefill", "prefill"]
    assert {r["status"] for r in records} == {"compiled"}
    assert all(Path(r["path"]).is_dir() for r in records)
