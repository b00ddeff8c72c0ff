"""The README's getting-started block runs as printed, and its set-up commands are what CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _blocks(text: str, lang: str) -> list[str]:
    """The bodies of every ```lang fenced block, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)


def _section(text: str, title: str) -> str:
    """The text under `## title`, up to the next `## ` heading."""
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"README has no '## {title}' section"
    return m.group(1)


def test_getting_started_block_runs_as_printed(tmp_path):
    """The first Python block of "Getting started", run alone in a fresh interpreter on the CPU
    (the reference path), prints the shapes and the decode = prefill check it promises."""
    blocks = _blocks(_section(README.read_text(), "Getting started"), "python")
    assert blocks, "no python block under Getting started"
    script = tmp_path / "getting_started.py"
    script.write_text(blocks[0])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES="", SPARSEGEN_CACHE_DIR=str(tmp_path / "cache"))  # fmt: skip
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "32 8 128", r.stdout
    assert "torch.Size([500, 32, 128])" in lines, r.stdout
    assert lines[-1] == "decode matches prefill's last row", r.stdout


def test_setup_commands_are_what_ci_runs():
    """The README's first block sets up with .ci/install, then builds the phi3small kernels or
    runs the very test command of .ci/run."""
    first = _blocks(README.read_text(), "bash")[0]
    commands = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert commands[0] == "bash .ci/install && sparsegen compile --pattern phi3small", commands
    assert commands[1].startswith("bash .ci/install && "), commands
    test_command = commands[1].removeprefix("bash .ci/install && ")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/install" in ci
    assert re.search(rf"^{re.escape(test_command)}$", ci, re.M), (test_command, ci)
