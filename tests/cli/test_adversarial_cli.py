"""Bad command lines, every command: exit 2 for a usage error and 1 for a runtime failure, with
exactly one line on stderr (`Error: ...`) naming the problem, nothing on stdout, no traceback.

In-process through click's CliRunner (fast); a few run as real subprocesses to check the same
holds for `python -m sparsegen`.
"""

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
HUGE = str(2**70)


def _spec_files(tmp: Path) -> dict[str, str]:
    files = {
        "not_json": "{ this is not json",
        "empty": "",
        "deep": "[" * 100_000 + "]" * 100_000,
        "wrong_shape": json.dumps([1, 2, 3]),
        "bad_field": json.dumps(
            {
                "layers": [
                    {
                        "num_heads": 2,
                        "num_kv_heads": 1,
                        "head_dim": 64,
                        "heads": [{"block_size": -4, "local_blocks": 1}] * 2,
                    }
                ]
            }
        ),  # fmt: skip
        "binary": "\udcff\udcfe",
    }
    out = {}
    for name, text in files.items():
        path = tmp / f"{name}.json"
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        out[name] = str(path)
    return out


def cases(tmp: Path) -> list[tuple[list[str], int, str]]:
    """(argv, exit code, a word the one error line must hold)."""
    files = _spec_files(tmp)
    prompts_bin = tmp / "prompts.bin"
    prompts_bin.write_bytes(b"\xff\xfe\x00\x80")
    bad_tok = tmp / "bad.tiktoken"
    bad_tok.write_text("not base64 at all\n")
    some_file = tmp / "plain.txt"
    some_file.write_text("x")
    missing = str(tmp / "missing" / "x.png")
    empty = tmp / "empty_dir"
    empty.mkdir()
    gen = ["generate", "--random", "tiny", "--prompt-ids", "1,2"]
    show = ["show", "--pattern", "phi3small"]
    comp = ["compile", "--pattern", "phi3small"]
    return [
        # the group
        (["no-such-command"], 2, "no-such-command"),
        (["--bogus"], 2, "--bogus"),
        # patterns
        (["patterns", "--bogus"], 2, "--bogus"),
        (["patterns", "extra-arg"], 2, "extra-arg"),
        # show
        (["show"], 2, "--pattern"),
        (["show", "--pattern", "no-such"], 2, "no-such"),
        (["show", "--pattern", ""], 2, "pattern"),
        (["show", "--pattern", str(tmp)], 2, "pattern"),
        *[(["show", "--pattern", path], 2, "pattern") for path in files.values()],
        ([*show, "--layer", "-1"], 2, "--layer"),
        ([*show, "--layer", "32"], 2, "--layer"),
        ([*show, "--layer", HUGE], 2, "--layer"),
        ([*show, "--layer", "one"], 2, "--layer"),
        ([*show, "--seq-len", "0"], 2, "--seq-len"),
        ([*show, "--seq-len", "-5"], 2, "--seq-len"),
        ([*show, "--seq-len", HUGE], 2, "--seq-len"),
        ([*show, "--seq-len", "1e3"], 2, "--seq-len"),
        ([*show, "--head", "32"], 2, "--head"),
        ([*show, "--head", "-1"], 2, "--head"),
        ([*show, "--png", missing], 2, "--png"),
        ([*show, "--png", str(tmp / "picture.unknownext")], 2, "--png"),
        ([*show, "--png", str(tmp / "no_extension")], 2, "--png"),
        ([*show, "--png", str(tmp)], 2, "--png"),
        ([*show, "--png", ""], 2, "--png"),
        ([*show, "--page-size", "0"], 2, "--page-size"),
        # compile
        (["compile"], 2, "--pattern"),
        (["compile", "--pattern", "no-such"], 2, "no-such"),
        ([*comp, "--arch", ""], 2, "--arch"),
        ([*comp, "--arch", "sm_90aa"], 2, "--arch"),
        ([*comp, "--arch", "90"], 2, "--arch"),
        ([*comp, "--arch", "sm_70"], 2, "--arch"),
        ([*comp, "--arch", "sm_"], 2, "--arch"),
        ([*comp, "--arch", "compute_90"], 2, "--arch"),
        ([*comp, "--arch", "sm_９０"], 2, "--arch"),
        ([*comp, "--dtype", "fp8"], 2, "--dtype"),
        ([*comp, "--kind", "everything"], 2, "--kind"),
        ([*comp, "--page-size", "0"], 2, "page"),
        ([*comp, "--page-size", "-16"], 2, "page"),
        ([*comp, "--page-size", "abc"], 2, "--page-size"),
        ([*comp, "--kind", "decode", "--page-size", "7"], 2, "page"),
        ([*comp, "--kind", "decode", "--page-size", HUGE], 2, "page"),
        # cache
        (["cache", "bogus"], 2, "bogus"),
        (["cache", "ls", "--bogus"], 2, "--bogus"),
        # fuzz
        (["fuzz"], 2, "--pattern"),
        (["fuzz", "--pattern", "phi3small", "--random"], 2, "--random"),
        (["fuzz", "--random", "--specs", "0"], 2, "--specs"),
        (["fuzz", "--random", "--examples", "0"], 2, "--examples"),
        (["fuzz", "--random", "--max-len", "0"], 2, "--max-len"),
        (["fuzz", "--random", "--seed", HUGE], 2, "--seed"),
        (["fuzz", "--random", "--seed", "-1"], 2, "--seed"),
        (["fuzz", "--random", "--kernel", "everything"], 2, "--kernel"),
        (["fuzz", "--pattern", files["deep"]], 2, "pattern"),
        (["fuzz", "--random", "--kernel", "decode"], 1, "GPU"),
        # generate
        (["generate", "--prompt-ids", "1"], 2, "--random"),
        (["generate", "--random", "tiny", "--model", str(tmp), "--prompt-ids", "1"], 2, "--random"),
        (["generate", "--random", "huge", "--prompt-ids", "1"], 2, "--random"),
        (["generate", "--random", "tiny"], 2, "prompt"),
        (["generate", "--random", "tiny", "--prompt-ids", "a,b"], 2, "--prompt-ids"),
        (["generate", "--random", "tiny", "--prompt-ids", ""], 2, "--prompt-ids"),
        (["generate", "--random", "tiny", "--prompt-ids", ","], 2, "--prompt-ids"),
        (["generate", "--random", "tiny", "--prompt-ids", "-1"], 2, "--prompt-ids"),
        (["generate", "--random", "tiny", "--prompt-ids", "99999999"], 2, "--prompt-ids"),
        (["generate", "--random", "tiny", "--prompt-ids", HUGE], 2, "--prompt-ids"),
        (["generate", "--random", "tiny", "--prompt-ids", "1.5"], 2, "--prompt-ids"),
        ([*gen, "--max-tokens", "0"], 2, "--max-tokens"),
        ([*gen, "--max-tokens", "-3"], 2, "--max-tokens"),
        ([*gen, "--temperature", "nan"], 2, "--temperature"),
        ([*gen, "--temperature", "inf"], 2, "--temperature"),
        ([*gen, "--temperature", "-1"], 2, "--temperature"),
        ([*gen, "--temperature", "warm"], 2, "--temperature"),
        ([*gen, "--top-p", "0"], 2, "--top-p"),
        ([*gen, "--top-p", "1.5"], 2, "--top-p"),
        ([*gen, "--top-p", "nan"], 2, "--top-p"),
        ([*gen, "--top-k", "-2"], 2, "--top-k"),
        ([*gen, "--seed", HUGE], 2, "--seed"),
        ([*gen, "--seed", "-1"], 2, "--seed"),
        ([*gen, "--seed", "abc"], 2, "--seed"),
        ([*gen, "--device", "tpu"], 2, "--device"),
        ([*gen, "--device", "meta"], 2, "--device"),
        ([*gen, "--device", ""], 2, "--device"),
        ([*gen, "--device", "cuda:x"], 2, "--device"),
        ([*gen, "--device", "cuda"], 2, "--device"),  # no GPU on the CPU tier
        ([*gen, "--dtype", "fp8"], 2, "--dtype"),
        ([*gen, "--max-batch", "0"], 2, "--max-batch"),
        ([*gen, "--chunk-size", "0"], 2, "--chunk-size"),
        ([*gen, "--page-size", "0"], 2, "--page-size"),
        (["generate", "--model", str(tmp / "nope"), "--prompt-ids", "1"], 2, "nope"),
        (["generate", "--model", str(some_file), "--prompt-ids", "1"], 2, "--model"),
        (["generate", "--model", str(empty), "--prompt-ids", "1"], 2, "config.json"),
        (["generate", "--random", "tiny", "--prompts-file", str(tmp / "nope.txt")], 2, "--prompts-file"),
        (["generate", "--random", "tiny", "--prompts-file", str(prompts_bin)], 2, "--prompts-file"),
        (["generate", "--random", "tiny", "--prompts-file", str(tmp)], 2, "--prompts-file"),
        (["generate", "--random", "tiny", "--tokenizer", str(bad_tok), "--prompt", "hi"], 2, "bad.tiktoken"),
        # bench (needs a GPU)
        (["bench", "--kind", "everything"], 2, "--kind"),
        (["bench"], 1, "GPU"),
        # env
        (["env", "--bogus"], 2, "--bogus"),
    ]


def assert_one_line_error(result, code: int, needle: str, argv) -> None:
    assert isinstance(result.exception, SystemExit) or result.exception is None, (
        argv,
        repr(result.exception),
        result.stderr,
    )
    assert result.exit_code == code, (argv, result.exit_code, result.stdout, result.stderr)
    assert result.stdout == "", (argv, result.stdout)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), (argv, result.stderr)
    assert needle.lower() in lines[0].lower(), (argv, needle, lines[0])
    assert "Traceback" not in result.stderr


def test_bad_command_lines(tmp_path, fresh_cache):
    runner = CliRunner()
    seen = 0
    for argv, code, needle in cases(tmp_path):
        result = runner.invoke(cli, argv)
        assert_one_line_error(result, code, needle, argv)
        seen += 1
    assert seen > 90


@pytest.mark.parametrize(
    ("env", "argv", "code", "needle"),
    [
        ({"SPARSEGEN_QUIET": "maybe"}, ["patterns"], 2, "SPARSEGEN_QUIET"),
        ({"SPARSEGEN_LOG_LEVEL": "loud"}, ["patterns"], 2, "SPARSEGEN_LOG_LEVEL"),
        (
            {"SPARSEGEN_DISABLE_JIT": "1"},
            ["compile", "--pattern", "dense", "--kind", "prefill"],
            1,
            "DISABLE_JIT",
        ),
        (
            {"SPARSEGEN_DISABLE_JIT": "perhaps"},
            ["compile", "--pattern", "dense", "--kind", "prefill"],
            2,
            "DISABLE_JIT",
        ),
    ],
)
def test_bad_environment(monkeypatch, fresh_cache, env, argv, code, needle):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert_one_line_error(CliRunner().invoke(cli, argv), code, needle, argv)


def test_unsafe_cache_dir_is_a_runtime_failure(monkeypatch, tmp_path):
    open_dir = tmp_path / "shared"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(open_dir))
    argv = ["compile", "--pattern", "dense", "--kind", "prefill"]
    assert_one_line_error(CliRunner().invoke(cli, argv), 1, "writable", argv)


def test_cache_clear_without_confirmation_aborts(fresh_cache):
    result = CliRunner().invoke(cli, ["cache", "clear"], input="n\n")
    assert result.exit_code == 1 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_python_dash_m_gives_the_same_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv, code, needle in [
        (["generate", "--random", "tiny", "--prompt-ids", "1", "--temperature", "nan"], 2, "--temperature"),
        (["compile", "--pattern", "phi3small", "--arch", ""], 2, "--arch"),
    ]:
        res = subprocess.run(
            [sys.executable, "-m", "sparsegen", *argv], capture_output=True, text=True, env=env, timeout=120
        )
        assert res.returncode == code and res.stdout == "", (argv, res.returncode, res.stdout, res.stderr)
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("Error: "), (argv, res.stderr)


def test_serve_without_its_extra_names_it(monkeypatch, fresh_cache):
    monkeypatch.setitem(sys.modules, "sparsegen.serve.server", None)  # import -> ImportError
    argv = ["serve", "--random", "tiny"]
    assert_one_line_error(CliRunner().invoke(cli, argv), 1, "sparsegen[serve]", argv)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["serve"], "--random"),
        (["serve", "--random", "tiny", "--port", "-1"], "--port"),
        (["serve", "--random", "tiny", "--port", "70000"], "--port"),
        (["serve", "--random", "huge"], "--random"),
    ],
)
def test_serve_bad_arguments(argv, needle, fresh_cache):
    assert_one_line_error(CliRunner().invoke(cli, argv), 2, needle, argv)
