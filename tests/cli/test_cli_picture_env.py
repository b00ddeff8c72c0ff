"""`show --png` (the figure's content), `sparsegen env`, and progress bars on a terminal only."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import extras

import sparsegen as sg
from sparsegen import env as sg_env
from sparsegen.cli import cli
from sparsegen.figure import distinct_heads, picture_tile

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_png_is_written_and_the_figure_groups_distinct_heads(tmp_path):
    extras.require("matplotlib")
    png = tmp_path / "phi3.png"
    res = CliRunner().invoke(cli, ["show", "--pattern", "phi3small", "--seq-len", "2048", "--png", str(png)])
    assert res.exit_code == 0, res.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert f"wrote {png}" in res.stderr and "wrote" not in res.stdout
    layer = sg.get_pattern("phi3small").layers[0]
    groups = distinct_heads(layer)
    assert groups[0] == [0, 8, 16, 24] and len(groups) == 8  # heads h and h+8 share a pattern
    assert picture_tile(layer, 8192) == (64, 8192) and picture_tile(layer, 131072) == (1024, 131072)
    svg = tmp_path / "phi3.svg"
    res = CliRunner().invoke(cli, ["show", "--pattern", "phi3small", "--json", "--png", str(svg)])
    assert res.exit_code == 0 and json.loads(res.stdout)["layer"] == 0
    text = svg.read_text()
    for needle in ("visible (read)", "causal but skipped", "not causal", "density 0.318", "kv 0 (q 0-3)",
                   "key position (tokens)"):  # fmt: skip
        assert needle in text, needle


def test_png_without_matplotlib_fails_before_the_report(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    res = CliRunner().invoke(cli, ["show", "--pattern", "phi3small", "--png", str(tmp_path / "x.png")])
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.strip() == "Error: --png needs matplotlib: pip install 'sparsegen[plot]'"


def test_env_reports_without_creating_the_cache(tmp_path, monkeypatch):
    root = tmp_path / "not-yet"
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(root))
    monkeypatch.setenv("SPARSEGEN_DEBUG", "1")
    res = CliRunner().invoke(cli, ["env", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert not root.exists() and report["cache"]["dir"] == str(root) and not report["cache"]["exists"]
    assert report["packages"]["torch"] == __import__("torch").__version__
    assert report["python"] == sys.version.split()[0] and report["gpus"] == []  # the CPU tier
    assert [v["name"] for v in report["variables"]] == list(sg_env.FLAGS)
    assert {v["name"]: v["value"] for v in report["variables"]}["SPARSEGEN_DEBUG"] == "1"
    root.mkdir(mode=0o700)
    assert json.loads(CliRunner().invoke(cli, ["env", "--json"]).stdout)["cache"]["verdict"] == "ok"
    root.chmod(0o777)
    verdict = json.loads(CliRunner().invoke(cli, ["env", "--json"]).stdout)["cache"]["verdict"]
    assert verdict.startswith("refused:") and "writable" in verdict
    text = CliRunner().invoke(cli, ["env"]).stdout
    assert "SPARSEGEN_DEBUG = '1'" in text and "kernel cache" in text


def test_readme_lists_every_variable():
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in sg_env.FLAGS if f"`{name}" not in readme]
    assert not missing, missing


def _run_on_pty(argv: list[str], env: dict) -> tuple[int, str, str]:
    """Run with stderr on a pseudo-terminal (a TTY) and stdout on a pipe: (rc, stdout, terminal)."""
    leader, follower = pty.openpty()
    # a new pty is 0 x 0, and tqdm draws nothing in 0 columns: give it a terminal's size
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=follower, env=env, cwd=ROOT)
    os.close(follower)
    seen = b""
    while True:
        ready, _, _ = select.select([leader], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    out = proc.stdout.read().decode()
    proc.wait(timeout=120)
    os.close(leader)
    return proc.returncode, out, seen.decode(errors="replace")


@pytest.mark.parametrize("json_flag", [False, True])
@pytest.mark.slow
def test_compile_bar_on_a_terminal_only(tmp_path, json_flag):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSEGEN_CACHE_DIR": str(cache)}
    env.pop("SPARSEGEN_QUIET", None)
    env.pop("TRITON_INTERPRET", None)  # `sparsegen fuzz` in-process sets it for this process
    argv = [sys.executable, "-m", "sparsegen", "compile", "--pattern", "phi3small", "--kind", "prefill",
            "--arch", "sm_80"] + (["--json"] if json_flag else [])  # fmt: skip
    rc, out, terminal = _run_on_pty(argv, env)
    assert rc == 0, terminal
    bar = "compile: " in terminal and "kernel/s" in terminal or "2/2 [" in terminal
    assert bar != json_flag, terminal  # a tqdm bar on the terminal, but never with --json
    assert "compiled prefill_bf16_hd128_h32kv8_bs64_l16_v8 (sm_80)" in terminal  # one line per kernel
    assert "\x1b" not in out and "compile:" not in out  # stdout stays data
    # stderr not a terminal: no bar, the same lines, each whole
    piped = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert piped.returncode == 0 and "\r" not in piped.stderr and "compile:" not in piped.stderr
    lines = piped.stderr.splitlines()
    assert all(line.startswith("sparsegen: ") for line in lines), lines
    assert sum("cached prefill_" in line for line in lines) == 2


def test_driver_release_from_proc_text():
    from sparsegen.commands.env import driver_release

    assert (
        driver_release("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Wed Jan  8 2025\n")
        == "570.86.15"
    )
    open_module = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs)\n"
    assert driver_release(open_module) == "580.65.06"
    assert driver_release("no driver here") is None


@pytest.mark.slow
def test_generate_bar_shows_tokens_per_second_on_a_terminal(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARSEGEN_CACHE_DIR": str(cache)}
    for name in ("SPARSEGEN_QUIET", "TRITON_INTERPRET"):
        env.pop(name, None)
    argv = [sys.executable, "-m", "sparsegen", "generate", "--random", "tiny", "--max-tokens", "48", "--ignore-eos",
            "--prompt-ids", "1,2", "--prompt-ids", "3,4,5", "--prompt-ids", "6"]  # fmt: skip
    rc, out, terminal = _run_on_pty(argv, env)
    assert rc == 0, terminal
    # tqdm redraws at most every 0.1 s: the prompts finish together after 48 decode steps (well over 0.1 s), so
    # the bar is drawn empty first and then with the rate; the final 3/3 may be skipped
    assert "generate:" in terminal and "/3 [" in terminal and "tok/s" in terminal, terminal
    # stdout: the outputs only (random weights: a text may hold a newline of its own)
    assert [line[:3] for line in out.splitlines() if line[:1] == "["][:3] == ["[0]", "[1]", "[2]"]
    assert "tok/s" not in out and "generate:" not in out
    assert "tokens/s overall" in terminal  # the summary is a message, on stderr
