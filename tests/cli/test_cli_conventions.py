"""CLI conventions: exit codes, one-line errors, stdout for data only, fast --help/--version,
`python -m sparsegen`, and the logging set-up (SPARSEGEN_QUIET, SPARSEGEN_LOG_LEVEL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from sparsegen.cli import cli

ROOT = Path(__file__).resolve().parents[2]


def _env(**extra) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.update(extra)
    return env


def _py(*args: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=_env(**env), timeout=120, cwd=ROOT
    )


@pytest.mark.parametrize("flag", ["--version", "--help"])
def test_version_and_help_do_not_import_torch(flag):
    code = (
        "import sys; from sparsegen.cli import cli\n"
        f"try:\n    cli([{flag!r}])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'numpy', 'jinja2') if m in sys.modules)\n"
        "print('HEAVY', heavy)"
    )
    res = _py("-c", code)
    assert res.returncode == 0, res.stderr
    assert "HEAVY []" in res.stdout, res.stdout
    if flag == "--version":
        import sparsegen

        assert f"version {sparsegen.__version__}" in res.stdout


def test_python_dash_m_is_the_cli():
    res = _py("-m", "sparsegen", "patterns", "--json")
    assert res.returncode == 0, res.stderr
    assert [r["name"] for r in json.loads(res.stdout)][0] == "phi3small"
    bad = _py("-m", "sparsegen", "show", "--pattern", "no-such")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and bad.stderr.startswith("Error: ") and "no-such" in bad.stderr


def test_runtime_failure_is_exit_1_one_line(fresh_cache, monkeypatch):
    monkeypatch.setenv("SPARSEGEN_DISABLE_JIT", "1")
    res = CliRunner().invoke(
        cli, ["compile", "--pattern", "phi3small", "--kind", "prefill", "--arch", "sm_80"]
    )
    assert res.exit_code == 1, res.output
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "SPARSEGEN_DISABLE_JIT" in lines[0]


def test_quiet_and_log_level(fresh_cache, monkeypatch):
    args = ["compile", "--pattern", "dense", "--kind", "prefill", "--arch", "sm_80", "--json"]
    monkeypatch.delenv("SPARSEGEN_QUIET", raising=False)
    loud = CliRunner().invoke(cli, args)
    assert loud.exit_code == 0, loud.output
    lines = loud.stderr.splitlines()  # one line per kernel, then the summary
    assert len(lines) == 2 and lines[0].startswith("sparsegen: [1/1] compiled prefill_"), lines
    assert " 1 compiled, 0 cached" in lines[1]
    json.loads(loud.stdout)  # stdout is pure data with --json
    from sparsegen.kernels import prefill as prefill_mod

    prefill_mod.forget()
    monkeypatch.setenv("SPARSEGEN_QUIET", "1")
    quiet = CliRunner().invoke(cli, args)
    assert quiet.exit_code == 0 and quiet.stderr == "", quiet.stderr
    assert [r["status"] for r in json.loads(quiet.stdout)] == ["cached"]
    monkeypatch.delenv("SPARSEGEN_QUIET")
    monkeypatch.setenv("SPARSEGEN_LOG_LEVEL", "warning")
    assert CliRunner().invoke(cli, args).stderr == ""
    monkeypatch.setenv("SPARSEGEN_LOG_LEVEL", "chatty")
    bad = CliRunner().invoke(cli, args)
    assert bad.exit_code == 2 and "SPARSEGEN_LOG_LEVEL" in bad.stderr and bad.stderr.count("\n") == 1


class _Stream:
    def __init__(self, tty: bool):
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_bars_only_on_a_terminal_without_json_and_not_quiet(monkeypatch):
    from sparsegen import log
    from sparsegen.commands import progress

    monkeypatch.delenv("SPARSEGEN_QUIET", raising=False)
    log.install_cli_handler()
    assert progress.bars_wanted(stream=_Stream(True))
    assert not progress.bars_wanted(stream=_Stream(False))
    assert not progress.bars_wanted(as_json=True, stream=_Stream(True))
    monkeypatch.setenv("SPARSEGEN_QUIET", "1")
    log.install_cli_handler()
    assert not progress.bars_wanted(stream=_Stream(True))
    off = progress.bar(3, "x")  # pytest's stderr is no terminal: a stand-in that draws nothing
    assert not off.drawn
    off.update(1, postfix="a")
    off.note("b")
    off.close()
    monkeypatch.delenv("SPARSEGEN_QUIET")
    log.install_cli_handler()  # leave the logger as the environment says, for later tests


def test_missing_extras_name_the_extra(monkeypatch):
    import sparsegen as sg
    from sparsegen import tokenizer

    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    with pytest.raises(sg.MissingExtraError, match=r"sparsegen\[model\]"):
        tokenizer.TiktokenTokenizer({b"a": 0}, {})
    monkeypatch.setitem(sys.modules, "hypothesis", None)
    monkeypatch.delitem(sys.modules, "sparsegen.testing", raising=False)
    with pytest.raises(sg.MissingExtraError, match=r"sparsegen\[fuzz\]"):
        import sparsegen.testing  # noqa: F401


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_engine_step_defaults_are_the_engine_configs(command):
    """--chunk-size and --page-size write EngineConfig's defaults out (so that --help imports no
    torch): they must not drift from it."""
    from sparsegen.runner.config import EngineConfig

    params = {p.name: p.default for p in cli.get_command(None, command).params}
    want = EngineConfig()
    assert params["chunk_size"] == want.max_num_batched_tokens
    assert params["page_size"] == want.page_size
    assert params["enable_prefix_caching"] == want.enable_prefix_caching
