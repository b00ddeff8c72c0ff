"""Adversarial tests of the kernel cache (jit/cache.py, jit/trusted_fs.py, `sparsegen cache`).

Classes (issue 11): trust (foreign owners, loose modes, links at every level, planted code with a
recomputed manifest hash), completeness (the loader's required files), wrong types (entry, lock,
manifest), leftovers (SIGKILL mid-write, then a sweep), `cache verify` / `cache ls` verdicts,
and the waiter's "waiting for ..." line. Every case checks the outcome and that nothing leaked:
no `.tmp-*` folder, no open descriptor, no lock left held.

Most cases drive `load_or_build` with a tiny fake kernel family whose loader imports `kernel.py`
the way the interpreter path does; planted code writes a marker file if it ever runs. One test
runs the real prefill interpreter path, one the real sm_90 AOT entry (cubin + metadata).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import itertools
import json
import logging
import os
import pwd
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsegen import CacheError, HeadSpec, JitDisabledError, LayerSpec
from sparsegen.cli import cli
from sparsegen.jit import cache, trusted_fs
from sparsegen.kernels import prefill as prefill_mod

AS_ROOT = os.getuid() == 0
needs_root = pytest.mark.skipif(
    not AS_ROOT, reason="chown to another user needs root (tests run as uid != 0)"
)
NOBODY = pwd.getpwnam("nobody").pw_uid if AS_ROOT else -1

REQUIRED = ("kernel.bin", "kernel.py")
_loads = itertools.count()


@pytest.fixture(autouse=True)
def root(fresh_cache, tmp_path):
    """A fresh cache; afterwards: no build folder left, no descriptor leaked."""
    fds = len(os.listdir("/proc/self/fd"))
    yield fresh_cache
    assert not [n for n in os.listdir(fresh_cache) if n.startswith(".tmp-")], "a build folder leaked"
    assert len(os.listdir("/proc/self/fd")) <= fds, "a descriptor leaked"


def _key(tag: str = "a") -> cache.KernelKey:
    return cache.KernelKey(f"adv_{tag}", hashlib.sha256(tag.encode()).hexdigest())


def _good_files(tag: str = "good") -> dict[str, bytes]:
    return {"kernel.py": f"TAG = {tag!r}\n".encode(), "kernel.bin": b"\x7fELF" + bytes(range(256)) * 8}


def _load(files: dict[str, Path]):
    """Imports kernel.py like triton_build.load_interpreted does (planted code would run here)."""
    spec = importlib.util.spec_from_file_location(f"sg_adv_kernel_{next(_loads)}", files["kernel.py"])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TAG, files["kernel.bin"].read_bytes()


class Builds:
    """A build callable that counts its calls."""

    def __init__(self, files=None):
        self.calls = 0
        self.files = files or _good_files()

    def __call__(self):
        self.calls += 1
        return dict(self.files), {"kind": "test", "arch": "sm_90", "dtype": "fp16"}


def _get(key=None, build=None, required=REQUIRED):
    return cache.load_or_build(key or _key(), build or Builds(), _load, required=required, label="adv kernel")


def _entry(root: Path, key=None) -> Path:
    return root / (key or _key()).key


def _rehash(entry: Path, drop: tuple[str, ...] = (), required: list | None = None) -> None:
    """Make the manifest self-consistent with the files now in the entry (what an attacker does)."""
    manifest = json.loads((entry / "manifest.json").read_text())
    for name in drop:
        manifest["files"].pop(name, None)
    for name in list(manifest["files"]):
        manifest["files"][name] = hashlib.sha256((entry / name).read_bytes()).hexdigest()
    if required is not None:
        manifest["required"] = required
    (entry / "manifest.json").write_text(json.dumps(manifest))


def _created(entry: Path) -> float:
    """The build time an entry's manifest records (a rebuild writes a new one)."""
    return json.loads((entry / "manifest.json").read_text())["created"]


def _planted(marker: Path) -> bytes:
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text('planted code ran')\nTAG = 'planted'\n".encode()


def _assert_rebuilt(found, build: Builds, marker: Path | None = None) -> None:
    assert found.status == "compiled" and build.calls == 1
    assert found.value[0] == "good"  # the fresh build was loaded, not what was on disk
    if marker is not None:
        assert not marker.exists(), "planted code ran"
    again = _get()
    assert again.status == "cached" and again.value[0] == "good"  # and the rebuilt entry is trusted


def _lock_free(root: Path, key=None) -> bool:
    fd = os.open(os.path.join(root, (key or _key()).key + ".lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Trust: owner, mode, links, at every level below the root.

FOREIGN = [
    # (what is chowned to nobody, mode applied to it or None)
    ("entry", None),
    ("entry", 0o777),
    ("entry", 0o755),
    ("kernel.py", None),
    ("kernel.py", 0o666),
    ("kernel.bin", None),
    ("manifest.json", None),
    ("manifest.json", 0o644),
]


@needs_root
@pytest.mark.parametrize(("target", "mode"), FOREIGN)
def test_foreign_owned_level_with_planted_code_never_runs(root, tmp_path, target, mode):
    _get()
    entry, marker = _entry(root), tmp_path / "marker"
    (entry / "kernel.py").write_bytes(_planted(marker))
    _rehash(entry)  # self-consistent: only the trust check can refuse it
    path = entry if target == "entry" else entry / target
    os.chown(path, NOBODY, NOBODY)
    if mode is not None:
        os.chmod(path, mode)
    build = Builds()
    _assert_rebuilt(_get(build=build), build, marker)
    leftovers = [n for n in os.listdir(root) if n.startswith(".quarantine-")]
    if target == "entry":  # not ours to delete: set aside, planted file kept for inspection
        assert len(leftovers) == 1 and (root / leftovers[0] / "kernel.py").read_bytes() == _planted(marker)
    else:  # our directory holding a foreign file: ours to remove
        assert leftovers == []


LOOSE_MODES = [0o777, 0o775, 0o757, 0o720, 0o702, 0o770]


@pytest.mark.parametrize("mode", LOOSE_MODES)
@pytest.mark.parametrize("target", ["entry", "kernel.py", "kernel.bin", "manifest.json"])
def test_loose_mode_at_any_level_is_rebuilt(root, tmp_path, target, mode):
    _get()
    entry, marker = _entry(root), tmp_path / "marker"
    (entry / "kernel.py").write_bytes(_planted(marker))
    _rehash(entry)
    path = entry if target == "entry" else entry / target
    os.chmod(path, mode if target == "entry" else mode & 0o666)
    build = Builds()
    _assert_rebuilt(_get(build=build), build, marker)
    assert not [n for n in os.listdir(root) if n.startswith(".quarantine-")]  # ours: removed


def _planted_entry(where: Path, key, marker: Path) -> Path:
    """A complete, self-consistent entry for `key` outside the cache, holding planted code."""
    where.mkdir(mode=0o700)
    files = {"kernel.py": _planted(marker), "kernel.bin": b"x"}
    for name, data in files.items():
        (where / name).write_bytes(data)
    manifest = {
        "key": key.key,
        "digest": key.digest,
        "files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()},
        "required": list(REQUIRED),
        "meta": {},
    }
    (where / "manifest.json").write_text(json.dumps(manifest))
    return where


@pytest.mark.parametrize("existing", [False, True])
def test_symlinked_entry_dir_is_not_followed(root, tmp_path, existing):
    marker, key = tmp_path / "marker", _key()
    target = _planted_entry(tmp_path / "elsewhere", key, marker)
    if existing:
        _get()
        cache.clear()
    _entry(root).symlink_to(target)
    build = Builds()
    _assert_rebuilt(_get(build=build), build, marker)
    assert not _entry(root).is_symlink()
    assert sorted(os.listdir(target)) == ["kernel.bin", "kernel.py", "manifest.json"]  # link not followed


@pytest.mark.parametrize("name", ["kernel.py", "kernel.bin", "manifest.json"])
@pytest.mark.parametrize("how", ["symlink", "hardlink-foreign"])
def test_linked_file_inside_entry_is_not_followed(root, tmp_path, name, how):
    if how == "hardlink-foreign" and not AS_ROOT:
        pytest.skip("a foreign-owned hard link needs root to chown (tests run as uid != 0)")
    _get()
    entry, marker = _entry(root), tmp_path / "marker"
    outside = tmp_path / f"outside-{name}"
    outside.write_bytes((entry / name).read_bytes() if name != "kernel.py" else _planted(marker))
    (entry / name).unlink()
    if how == "symlink":
        (entry / name).symlink_to(outside)
    else:
        os.chown(outside, NOBODY, NOBODY)
        os.link(outside, entry / name)
    if name != "manifest.json":
        _rehash(entry)
    build = Builds()
    _assert_rebuilt(_get(build=build), build, marker)
    assert outside.exists() and (name != "kernel.py" or outside.read_bytes() == _planted(marker))


@needs_root
def test_real_interpreter_prefill_planted_kernel_never_runs(root, tmp_path, monkeypatch):
    """The issue's example on the real path: a foreign 0777 entry with an edited kernel.py and a
    recomputed manifest hash, loaded by the Triton-interpreter prefill kernel."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layer = LayerSpec(
        num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(block_size=16, local_blocks=2),) * 2
    )
    first = prefill_mod.get_prefill_kernel(layer, dtype=torch.float16)
    entry, marker = Path(first.path), tmp_path / "marker"
    good = (entry / "kernel.py").read_bytes()
    (entry / "kernel.py").write_bytes(_planted(marker) + good)
    _rehash(entry)
    os.chown(entry, NOBODY, NOBODY)
    os.chmod(entry, 0o777)
    before = _created(entry)
    prefill_mod.forget()
    again = prefill_mod.get_prefill_kernel(layer, dtype=torch.float16)
    assert Path(again.path) == entry and _created(entry) != before and not marker.exists()  # rebuilt
    assert (entry / "kernel.py").read_bytes() == good and os.lstat(entry).st_uid == os.getuid()
    (aside,) = [n for n in os.listdir(root) if n.startswith(".quarantine-")]  # foreign: kept aside
    assert (root / aside / "kernel.py").read_bytes().startswith(_planted(marker))


# ---------------------------------------------------------------------------------------------
# The root: a one-line CacheError, nothing built or loaded.


def _unsafe_roots(tmp_path: Path):
    cases = []
    for mode in (0o777, 0o775, 0o757, 0o1777):
        d = tmp_path / f"root-{mode:o}"
        d.mkdir()
        d.chmod(mode)
        cases.append((d, "writable by group or others"))
    f = tmp_path / "root-file"
    f.write_text("x")
    cases.append((f, "cannot create"))
    if AS_ROOT:
        d = tmp_path / "root-nobody"
        d.mkdir(mode=0o700)
        os.chown(d, NOBODY, NOBODY)
        cases.append((d, "not owned by this user"))
        link = tmp_path / "root-link-to-nobody"
        link.symlink_to(d)
        cases.append((link, "not owned by this user"))
    loose = tmp_path / "root-link-to-loose"
    loose.symlink_to(tmp_path / "root-777")
    cases.append((loose, "writable by group or others"))
    return cases


def test_unsafe_root_is_one_line_cache_error(tmp_path, monkeypatch):
    for path, words in _unsafe_roots(tmp_path):
        monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(path))
        build = Builds()
        calls = (lambda b=build: _get(build=b), cache.verify_entries, cache.clear, lambda: cache.sweep(0))
        for call in calls:
            with pytest.raises(CacheError, match=words) as err:
                call()
            assert "\n" not in str(err.value)
        assert build.calls == 0
        result = CliRunner().invoke(cli, ["cache", "verify"])
        assert result.exit_code != 0 and words in result.output and "Traceback" not in result.output


def test_root_may_be_a_link_the_user_made_to_a_safe_directory(tmp_path, monkeypatch):
    real = tmp_path / "real-root"
    real.mkdir(mode=0o700)
    (tmp_path / "root-link").symlink_to(real)
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path / "root-link"))
    build = Builds()
    assert _get(build=build).status == "compiled" and _get().status == "cached"
    assert os.path.isdir(real / _key().key)


# ---------------------------------------------------------------------------------------------
# Completeness: the loader's required files decide, not the manifest.


@pytest.mark.parametrize(
    "drop",
    [("kernel.bin",), ("kernel.py",)],
)
@pytest.mark.parametrize("edit_required", [False, True])
def test_manifest_listing_too_few_files_is_rebuilt(root, drop, edit_required):
    _get()
    entry = _entry(root)
    for name in drop:
        (entry / name).unlink()
    _rehash(entry, drop=drop, required=[] if edit_required else None)
    build = Builds()
    _assert_rebuilt(_get(build=build), build)


def test_extra_unlisted_file_is_rebuilt(root, tmp_path):
    for extra in ("evil.py", "kernel.pyc", "__init__.py", ".hidden", "sub"):
        _get()
        entry = _entry(root)
        if extra == "sub":
            (entry / extra).mkdir()
        else:
            (entry / extra).write_text("import os\n")
        build = Builds()
        _assert_rebuilt(_get(build=build), build)
        assert not (entry / extra).exists()


def test_real_prefill_entry_checks_cubin_and_metadata(root):
    """sm_90 AOT (no GPU): a truncated cubin shows as BAD in ls/verify and is rebuilt; a cubin or
    metadata file deleted and dropped from a self-consistent manifest is rebuilt too."""
    layer = LayerSpec(
        num_heads=2, num_kv_heads=1, head_dim=64, heads=(HeadSpec(block_size=16, local_blocks=2),) * 2
    )
    kernel = prefill_mod.get_prefill_kernel(layer, dtype=torch.float16, arch="sm_90")
    entry = Path(kernel.path)
    cubin = entry / "prefill_kernel.cubin"
    cubin.write_bytes(cubin.read_bytes()[:100])
    runner = CliRunner()
    ls = runner.invoke(cli, ["cache", "ls"])
    assert (
        ls.exit_code == 0 and "BAD: has a file prefill_kernel.cubin that does not match its hash" in ls.output
    )
    verify = runner.invoke(cli, ["cache", "verify", "--json"])
    assert verify.exit_code == 1 and [e["ok"] for e in json.loads(verify.stdout)] == [False]
    for drop in ("prefill_kernel.cubin", "prefill_kernel.json", None):
        before = _created(entry)
        prefill_mod.forget()
        again = prefill_mod.get_prefill_kernel(layer, dtype=torch.float16, arch="sm_90")
        assert Path(again.path) == entry and _created(entry) != before  # rebuilt, not trusted
        assert cubin.stat().st_size > 1000
        assert runner.invoke(cli, ["cache", "verify"]).exit_code == 0
        if drop:
            (entry / drop).unlink()
            _rehash(entry, drop=(drop,), required=["kernel.py"])  # even the recorded list is edited


# ---------------------------------------------------------------------------------------------
# Wrong types: entry, lock, manifest.


def _make_entry_kind(path: Path, kind: str, tmp_path: Path) -> None:
    if kind == "file":
        path.write_text("not a directory")
    elif kind == "empty-file":
        path.write_bytes(b"")
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "socket":  # bound by a relative name: a deep tmp_path exceeds AF_UNIX's 108 bytes
        here = os.getcwd()
        with socket.socket(socket.AF_UNIX) as s:
            os.chdir(path.parent)
            try:
                s.bind(path.name)
            finally:
                os.chdir(here)
    elif kind == "dangling-link":
        path.symlink_to(tmp_path / "nowhere")
    elif kind == "link-to-devnull":
        path.symlink_to("/dev/null")
    elif kind == "link-to-root":
        path.symlink_to("/")
    elif kind == "link-loop":
        path.symlink_to(path.name)
    elif kind == "empty-dir":
        path.mkdir(mode=0o700)
    elif kind == "dir-no-manifest":
        path.mkdir(mode=0o700)
        (path / "kernel.py").write_text("TAG = 'x'\n")
    else:
        raise AssertionError(kind)


ENTRY_KINDS = [
    "file",
    "empty-file",
    "fifo",
    "socket",
    "dangling-link",
    "link-to-devnull",
    "link-to-root",
    "link-loop",
    "empty-dir",
    "dir-no-manifest",
]


@pytest.mark.parametrize("kind", ENTRY_KINDS)
def test_entry_path_of_wrong_type_is_rebuilt(root, tmp_path, kind):
    _make_entry_kind(_entry(root), kind, tmp_path)
    build = Builds()
    _assert_rebuilt(_get(build=build), build)


@pytest.mark.parametrize("kind", ENTRY_KINDS)
def test_entry_path_of_wrong_type_under_disable_jit_is_one_line(root, tmp_path, monkeypatch, kind):
    _make_entry_kind(_entry(root), kind, tmp_path)
    monkeypatch.setenv("SPARSEGEN_DISABLE_JIT", "1")
    with pytest.raises(JitDisabledError, match="forbids compiling") as err:
        _get()
    assert "\n" not in str(err.value)


LOCK_KINDS = [
    "dir",
    "dir-with-files",
    "dangling-link",
    "link-to-victim",
    "hardlink-to-victim",
    "fifo",
    "socket",
    "foreign",
    "loose",
]


@pytest.mark.parametrize("kind", LOCK_KINDS)
def test_lock_path_of_wrong_type(root, tmp_path, kind):
    if kind == "foreign" and not AS_ROOT:
        pytest.skip("chown to another user needs root (tests run as uid != 0)")
    lock = root / (_key().key + ".lock")
    victim = tmp_path / "victim"
    victim.write_text("precious")
    if kind == "dir":
        lock.mkdir()
    elif kind == "dir-with-files":
        lock.mkdir()
        (lock / "f").write_text("x")
    elif kind == "dangling-link":
        lock.symlink_to(tmp_path / "nowhere")
    elif kind == "link-to-victim":
        lock.symlink_to(victim)
    elif kind == "hardlink-to-victim":  # a loose-mode file of ours: its mode must not be changed
        victim.chmod(0o664)
        os.link(victim, lock)
    elif kind in ("fifo", "socket"):
        _make_entry_kind(lock, kind, tmp_path)
    else:
        lock.write_text("")
        os.chmod(lock, 0o666)
        if kind == "foreign":
            os.chown(lock, NOBODY, NOBODY)
    build = Builds()
    found = _get(build=build)
    assert found.status == "compiled" and build.calls == 1 and found.value[0] == "good"
    st = os.lstat(lock)
    assert trusted_fs.untrusted(st, want_dir=False) is None and (st.st_mode & 0o777) == 0o600
    assert victim.read_text() == "precious" and not (tmp_path / "nowhere").exists()
    assert kind != "hardlink-to-victim" or stat.S_IMODE(victim.stat().st_mode) == 0o664
    assert _lock_free(root)


def _manifest_cases(key) -> list[tuple[str, bytes]]:
    good = {
        "key": key.key,
        "digest": key.digest,
        "files": {"kernel.py": "0" * 64, "kernel.bin": "0" * 64},
        "required": list(REQUIRED),
        "meta": {},
    }

    def edit(**fields):
        return json.dumps({**good, **fields}).encode()

    return [
        ("empty", b""),
        ("not-json", b"{"),
        ("binary", b"\xff\xfe\x00\x01"),
        ("nan", b"NaN"),
        ("deep-list", b"[" * 100_000 + b"]" * 100_000),
        (
            "deep-meta",
            edit(meta=0)[:-1].replace(b'"meta": 0', b'"meta": ' + b"[" * 5000 + b"]" * 5000) + b"}",
        ),
        ("list", b"[1, 2]"),
        ("string", b'"manifest"'),
        ("null", b"null"),
        ("number", b"7"),
        ("key-int", edit(key=7)),
        ("key-other", edit(key="adv_b-" + "0" * 24)),
        ("digest-short", edit(digest="abc")),
        ("digest-other", edit(digest="f" * 64)),
        ("digest-list", edit(digest=[key.digest])),
        ("files-list", edit(files=["kernel.py", "kernel.bin"])),
        ("files-empty", edit(files={})),
        ("files-null", edit(files=None)),
        ("hash-int", edit(files={"kernel.py": 1, "kernel.bin": 2})),
        ("hash-upper", edit(files={"kernel.py": "A" * 64, "kernel.bin": "0" * 64})),
        ("name-dotdot", edit(files={"../kernel.py": "0" * 64, "kernel.bin": "0" * 64})),
        ("name-abs", edit(files={"/etc/passwd": "0" * 64, "kernel.bin": "0" * 64})),
        ("name-slash", edit(files={"a/kernel.py": "0" * 64, "kernel.bin": "0" * 64})),
        ("name-hidden", edit(files={".kernel.py": "0" * 64, "kernel.bin": "0" * 64})),
        ("name-empty", edit(files={"": "0" * 64, "kernel.bin": "0" * 64})),
        ("name-nul", edit(files={"kernel.py\x00": "0" * 64, "kernel.bin": "0" * 64})),
        ("name-manifest", edit(files={"manifest.json": "0" * 64, "kernel.bin": "0" * 64})),
        ("name-long", edit(files={"k" * 5000: "0" * 64, "kernel.bin": "0" * 64})),
        ("many-files", edit(files={f"f{i}": "0" * 64 for i in range(10_000)})),
        ("meta-list", edit(meta=[1])),
        ("required-str", edit(required="kernel.py")),
        ("required-ints", edit(required=[1, 2])),
        ("huge", b" " * (2 << 20) + json.dumps(good).encode()),
        ("stale-hashes", edit()),
    ]


@pytest.mark.parametrize("case", range(34))
def test_manifest_of_wrong_shape_is_rebuilt(root, case):
    _get()
    name, data = _manifest_cases(_key())[case]
    (_entry(root) / "manifest.json").write_bytes(data)
    build = Builds()
    _assert_rebuilt(_get(build=build), build)
    listing = cache.verify_entries()
    assert [e["ok"] for e in listing] == [True], name


def test_manifest_case_count():
    assert len(_manifest_cases(_key())) == 34  # the parametrize above covers every case


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=80),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=20), inner, max_size=4),
    max_leaves=12,
)
FIELDS = st.sampled_from(["key", "digest", "files", "required", "meta", "created", None])


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)
@given(field=FIELDS, value=JSON)
def test_fuzzed_manifest_never_crashes_and_is_never_half_trusted(root, field, value):
    """Any JSON in any manifest field (or as the whole manifest): never a traceback, never the
    planted kernel.py. A change to what gates loading (key, digest, files, the whole manifest)
    rebuilds; the informational fields (meta, required, created) may change if well typed."""
    cache.clear()
    _get()
    path = _entry(root) / "manifest.json"
    manifest = json.loads(path.read_text())
    before = dict(manifest)
    if field is None:
        manifest = value
    else:
        manifest[field] = value
    if field == "files":  # a planted file the new 'files' might list
        (_entry(root) / "kernel.py").write_text("TAG = 'planted'\n")
    path.write_text(json.dumps(manifest))
    build = Builds()
    found = _get(build=build)
    assert found.value[0] == "good"
    if isinstance(manifest, dict) and manifest == before:
        assert found.status == "cached"
    elif field in (None, "key", "digest", "files"):
        assert found.status == "compiled"
    else:
        well_typed = {"meta": isinstance(value, dict), "required": isinstance(value, list)
                      and all(isinstance(x, str) for x in value), "created": True}[field]  # fmt: skip
        assert found.status == ("cached" if well_typed else "compiled")


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)
@given(
    name=st.sampled_from(["kernel.py", "kernel.bin", "manifest.json"]),
    cut=st.integers(0, 4000),
    flip=st.one_of(st.none(), st.integers(0, 4000)),
)
def test_fuzzed_truncation_or_bit_flip_is_rebuilt(root, name, cut, flip):
    cache.clear()
    _get()
    path = _entry(root) / name
    data = bytearray(path.read_bytes())
    edited = bytearray(data[:cut])
    if flip is not None and edited and name != "manifest.json":  # a manifest flip may hit 'created'
        edited[flip % len(edited)] ^= 0x01
    path.write_bytes(bytes(edited))
    build = Builds()
    found = _get(build=build)
    changed = bytes(edited) != bytes(data)
    assert found.value[0] == "good" and found.status == ("compiled" if changed else "cached")
    verdicts = cache.verify_entries()
    assert [v["ok"] for v in verdicts] == [True]


@pytest.mark.parametrize("kind", ["dir", "link", "fifo", "missing"])
def test_manifest_path_of_wrong_type_is_rebuilt(root, tmp_path, kind):
    _get()
    manifest = _entry(root) / "manifest.json"
    saved = manifest.read_bytes()
    manifest.unlink()
    if kind == "dir":
        manifest.mkdir()
    elif kind == "link":
        (tmp_path / "m.json").write_bytes(saved)
        manifest.symlink_to(tmp_path / "m.json")
    elif kind == "fifo":
        os.mkfifo(manifest, 0o600)  # reading it must not hang: O_NONBLOCK and a type check first
    build = Builds()
    _assert_rebuilt(_get(build=build), build)


# ---------------------------------------------------------------------------------------------
# Bad arguments from a kernel family: typed, one line, nothing left behind.


@pytest.mark.parametrize(
    "name", ["", "../x", "a/b", ".hidden", "x" * 201, "a\x00b", "a b", "-", 7, None, "ä"]
)
def test_unsafe_kernel_name_is_a_cache_error(name):
    with pytest.raises(CacheError, match="kernel name"):
        cache.KernelKey(name, "0" * 64)


@pytest.mark.parametrize("digest", ["", "0" * 63, "0" * 65, "G" * 64, "A" * 64, 7, None])
def test_bad_digest_is_a_cache_error(digest):
    with pytest.raises(CacheError, match="digest"):
        cache.KernelKey("adv", digest)


BAD_BUILDS = [
    ("required missing", lambda: ({"kernel.py": b"TAG='good'\n"}, {}), "gave no kernel.bin"),
    ("bad file name", lambda: ({**_good_files(), "../x": b""}, {}), "invalid cache file name"),
    ("manifest name", lambda: ({**_good_files(), "manifest.json": b"{}"}, {}), "invalid cache file name"),
    ("str data", lambda: ({**_good_files(), "x": "text"}, {}), "must be bytes"),
    ("meta not json", lambda: (_good_files(), {"x": object()}), "not JSON"),
    ("not a tuple", lambda: _good_files(), "must return"),
    ("too many files", lambda: ({**_good_files(), **{f"f{i}": b"" for i in range(100)}}, {}), "1 to 64"),
]


@pytest.mark.parametrize(("what", "build", "words"), BAD_BUILDS, ids=[b[0] for b in BAD_BUILDS])
def test_bad_build_output_is_one_line_and_leaves_nothing(root, what, build, words):
    with pytest.raises(CacheError, match=words) as err:
        cache.load_or_build(_key(), build, _load, required=REQUIRED, label="adv kernel")
    assert "\n" not in str(err.value)
    assert [n for n in os.listdir(root) if not n.endswith(".lock")] == []
    assert _lock_free(root)


@pytest.mark.parametrize("required", ["kernel.py", ["../x"], ["manifest.json"], [7], [""]])
def test_bad_required_list_is_a_cache_error(required):
    with pytest.raises(CacheError, match="required"):
        _get(required=required)


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS])
@pytest.mark.parametrize("where", ["write_file", "rename", "mkdir"])
def test_failed_write_is_one_line_and_leaves_nothing(root, monkeypatch, err, where):
    def fail(*args, **kwargs):
        raise OSError(err, os.strerror(err))

    target = trusted_fs if where == "write_file" else cache.os
    with monkeypatch.context() as patch:
        patch.setattr(target, where, fail)
        with pytest.raises(CacheError, match=f"cannot write the cache entry .*{os.strerror(err)}") as caught:
            _get()
    assert "\n" not in str(caught.value) and _lock_free(root)
    assert [n for n in os.listdir(root) if not n.endswith(".lock")] == []
    build = Builds()
    _assert_rebuilt(_get(build=build), build)  # the next try works


def test_build_that_raises_leaves_no_tmp_and_frees_the_lock(root):
    def boom():
        raise RuntimeError("compiler crashed")

    with pytest.raises(RuntimeError, match="compiler crashed"):
        cache.load_or_build(_key(), boom, _load, required=REQUIRED, label="adv kernel")
    assert _lock_free(root) and not _entry(root).exists()


# ---------------------------------------------------------------------------------------------
# The window between the check and the open.


def _racing_open(monkeypatch, target: str, swap):
    """os.open in trusted_fs, with `swap()` run once right before `target` is opened."""
    real_open, swapped = os.open, []

    def racing_open(path, flags, *args, **kwargs):
        if path == target and not swapped:  # the attacker wins the race between lstat and open
            swapped.append(1)
            swap()
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(trusted_fs.os, "open", racing_open)
    return swapped


@pytest.mark.parametrize("swap", ["symlink", "foreign-hardlink"])
def test_swap_between_lstat_and_open_is_caught(root, tmp_path, monkeypatch, swap):
    if swap == "foreign-hardlink" and not AS_ROOT:
        pytest.skip("a foreign-owned hard link needs root to chown (tests run as uid != 0)")
    _get()
    entry, marker = _entry(root), tmp_path / "marker"
    planted = tmp_path / "planted.py"
    planted.write_bytes(_planted(marker))

    def attack():
        (entry / "kernel.py").unlink()
        if swap == "symlink":
            (entry / "kernel.py").symlink_to(planted)
        else:
            os.chown(planted, NOBODY, NOBODY)
            os.link(planted, entry / "kernel.py")
        _rehash(entry)  # the hashes agree: only the type/owner/inode checks stand in the way

    build = Builds()
    with monkeypatch.context() as patch:
        swapped = _racing_open(patch, "kernel.py", attack)
        found = _get(build=build)
    assert swapped
    _assert_rebuilt(found, build, marker)


def test_inode_swapped_after_lstat_is_refused(root, monkeypatch):
    _get()
    entry = _entry(root)
    dfd = os.open(entry, os.O_RDONLY | os.O_DIRECTORY)
    try:

        def attack():  # another regular file of ours takes the name: same type, same owner
            (entry / "other").write_bytes((entry / "kernel.py").read_bytes())
            os.rename(entry / "other", entry / "kernel.py")

        with monkeypatch.context() as patch:
            swapped = _racing_open(patch, "kernel.py", attack)
            fd, problem = trusted_fs.open_checked("kernel.py", dfd, want_dir=False)
        assert swapped and fd is None and problem == "changed while it was being checked"
        fd, problem = trusted_fs.open_checked("kernel.py", dfd, want_dir=False)  # no race: fine
        assert problem is None
        os.close(fd)
    finally:
        os.close(dfd)


# ---------------------------------------------------------------------------------------------
# Leftovers: a build killed mid-write, then a sweep.

KILLED_BUILD = """
import sys, time
from sparsegen.jit import cache, trusted_fs
real = trusted_fs.write_file
def slow_write(dir_fd, name, data):
    real(dir_fd, name, data)
    print("wrote", name, flush=True)
    time.sleep(60)  # SIGKILLed here, mid-write
trusted_fs.write_file = slow_write
key = cache.KernelKey("adv_a", sys.argv[1])
cache.load_or_build(key, lambda: ({"kernel.py": b"TAG = 'x'\\n", "kernel.bin": b"x"}, {}),
                    lambda f: None, required=("kernel.py", "kernel.bin"), label="killed build")
"""


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}


def test_sigkill_mid_write_leaves_a_tmp_that_the_sweep_removes(root):
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_BUILD, _key().digest], env=_env(), stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().startswith("wrote")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    tmps = [n for n in os.listdir(root) if n.startswith(".tmp-")]
    assert len(tmps) == 1 and not _entry(root).exists()
    assert _lock_free(root)  # the kernel dropped the dead process's lock
    assert cache.sweep() == []  # fresh: not stale yet
    assert cache.leftovers() == tmps
    assert cache.sweep(0) == tmps and cache.leftovers() == []
    build = Builds()
    _assert_rebuilt(_get(build=build), build)


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
"""


def _hold_lock(root: Path, seconds: float, key=None) -> subprocess.Popen:
    lock = str(root / ((key or _key()).key + ".lock"))
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, lock, str(seconds)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_sweep_keeps_live_foreign_and_fresh_builds(root):
    old = time.time() - 3600
    names = {}
    for tag in ("dead", "live", "fresh", "foreign"):
        key = _key(tag)
        name = f".tmp-{key.key}-abcd1234"
        (root / name).mkdir(mode=0o700)
        (root / name / "kernel.py").write_text("x")
        if tag != "fresh":
            os.utime(root / name, (old, old))
        if tag == "foreign" and AS_ROOT:
            os.chown(root / name, NOBODY, NOBODY)
        names[tag] = name
    holder = _hold_lock(root, 30, _key("live"))
    try:
        removed = cache.sweep()
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    expect = {names["dead"]} | (set() if AS_ROOT else {names["foreign"]})
    assert set(removed) == expect
    assert {names["live"], names["fresh"]} <= set(os.listdir(root))
    assert cache.sweep() == [names["live"]]  # its lock is free now
    for name in (names["fresh"], names["foreign"]):  # tidy for the fixture's leak check
        subprocess.run(["rm", "-rf", str(root / name)], check=True)


def test_a_build_sweeps_stale_leftovers(root):
    stale = root / f".tmp-{_key('other').key}-00000000"
    stale.mkdir(mode=0o700)
    os.utime(stale, (time.time() - 3600,) * 2)
    link = root / ".quarantine-0000-x"
    link.symlink_to("/")
    _get()
    assert not stale.exists() and not os.path.lexists(link) and os.path.isdir("/etc")


def test_sweep_rejects_bad_threshold():
    for bad in (-1, float("nan"), "10", True, None):
        with pytest.raises(CacheError, match="older_than"):
            cache.sweep(bad)


# ---------------------------------------------------------------------------------------------
# The waiter.


class _Records(logging.Handler):
    """Collects what reaches the "sparsegen" logger itself (it may not propagate to the root)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def sparsegen_log():
    logger, records = logging.getLogger("sparsegen"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    yield records.lines
    logger.removeHandler(records)
    logger.setLevel(level)


@pytest.mark.slow
def test_waiter_logs_that_another_process_holds_the_lock(root, sparsegen_log):
    holder = _hold_lock(root, 2.5)  # > 1 s notice, with margin for a loaded machine
    try:
        start = time.monotonic()
        build = Builds()
        found = _get(build=build)
        waited = time.monotonic() - start
    finally:
        holder.wait(timeout=30)
        holder.stdout.close()
    assert "waiting for adv kernel (locked by another process)" in sparsegen_log
    assert found.status == "compiled" and build.calls == 1 and 1.0 <= waited < 20


def test_no_waiting_line_when_the_lock_is_free(root, sparsegen_log):
    _get()
    assert not [line for line in sparsegen_log if "waiting for" in line]


# ---------------------------------------------------------------------------------------------
# `sparsegen cache ls|verify|sweep|clear` on a cache with good and bad entries.


def test_cli_ls_and_verify_report_each_entry(root, tmp_path):
    for tag in ("good", "trunc", "loose", "link", "edited"):
        _get(key=_key(tag))
    entries = {tag: _entry(root, _key(tag)) for tag in ("good", "trunc", "loose", "link", "edited")}
    binf = entries["trunc"] / "kernel.bin"
    binf.write_bytes(binf.read_bytes()[:10])
    os.chmod(entries["loose"], 0o777)
    subprocess.run(["rm", "-rf", str(entries["link"])], check=True)
    entries["link"].symlink_to(entries["good"])
    (entries["edited"] / "kernel.py").write_text("TAG = 'edited'\n")
    runner = CliRunner()
    verify = runner.invoke(cli, ["cache", "verify"])
    assert verify.exit_code == 1, verify.output
    by_key = {line.split()[1].rstrip(":"): line for line in verify.stdout.splitlines()}
    assert by_key[_key("good").key].startswith("ok")
    assert "does not match its hash" in by_key[_key("trunc").key]
    assert "writable by group or others" in by_key[_key("loose").key]
    assert "is a symlink" in by_key[_key("link").key]
    assert "kernel.py that does not match its hash" in by_key[_key("edited").key]
    as_json = json.loads(runner.invoke(cli, ["cache", "verify", "--json"]).stdout)
    assert sorted(e["key"] for e in as_json if e["ok"]) == [_key("good").key]
    listing = json.loads(runner.invoke(cli, ["cache", "ls", "--json"]).stdout)
    assert {e["key"]: e["ok"] for e in listing} == {e["key"]: e["ok"] for e in as_json}
    sizes = {e["key"]: e["bytes"] for e in listing}
    assert sizes[_key("trunc").key] == sum(f.stat().st_size for f in entries["trunc"].iterdir())
    assert sizes[_key("link").key] == os.lstat(entries["link"]).st_size  # the link itself, not followed
    table = runner.invoke(cli, ["cache", "ls"]).stdout
    assert table.count("BAD:") == 4 and "verdict" in table
    assert runner.invoke(cli, ["cache", "sweep", "--older-than", "0"]).exit_code == 0
    assert runner.invoke(cli, ["cache", "sweep", "--older-than", "-1"]).exit_code == 2
    assert "removed 5 entries" in runner.invoke(cli, ["cache", "clear", "--yes"]).stdout
    assert runner.invoke(cli, ["cache", "verify"]).exit_code == 0
    assert entries["good"].exists() is False and os.listdir(tmp_path / "cache") == []


def test_clear_never_follows_a_link_and_keeps_foreign_entries(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep")
    (root / ("adv_link-" + "0" * 24)).symlink_to(outside)
    _get()
    if AS_ROOT:
        os.chown(_entry(root), NOBODY, NOBODY)
    removed = cache.clear()
    assert (outside / "precious").read_text() == "keep"
    assert removed == (1 if AS_ROOT else 2)
    assert os.path.exists(_entry(root)) == AS_ROOT
    if AS_ROOT:
        subprocess.run(["rm", "-rf", str(_entry(root))], check=True)
