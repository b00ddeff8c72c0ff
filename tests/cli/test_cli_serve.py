"""`sparsegen serve`'s usage errors: one line and exit 2, before anything listens."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from helpers import extras

from sparsegen.cli import cli

extras.require("fastapi")


@pytest.mark.parametrize(
    "args,msg",
    [
        ([], "exactly one of --model DIR or --random"),
        (["--random", "tiny", "--model", "."], "exactly one of"),
        (["--random", "huge"], "--random"),
        (["--model", "/nonexistent/dir"], "--model"),
        (["--random", "tiny", "--port", "70000"], "--port"),
        (["--random", "tiny", "--max-queue", "-1"], "--max-queue"),
        (["--random", "tiny", "--device", "tpu"], "device"),
        (["--random", "tiny", "--dtype", "int8"], "--dtype"),
        (["--random", "tiny", "--page-size", "0"], "--page-size"),
        (["--random", "tiny", "--drain-timeout", "-1"], "--drain-timeout"),
    ],
)
def test_serve_usage_errors(args, msg):
    res = CliRunner().invoke(cli, ["serve", *args])
    assert res.exit_code == 2, res.output
    assert msg in res.output and "Traceback" not in res.output


def test_a_port_in_use_is_one_line_and_exit_1():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        res = CliRunner().invoke(cli, ["serve", "--random", "tiny", "--no-warmup", "--port", str(port)])
    assert res.exit_code == 1 and f"cannot serve on 127.0.0.1:{port}" in res.output
    assert "Traceback" not in res.output


def test_without_the_serve_extra_it_names_the_extra(monkeypatch):
    import sys

    for mod in ("fastapi", "sparsegen.serve.server", "sparsegen.serve.app"):
        monkeypatch.delitem(sys.modules, mod, raising=False)
    monkeypatch.setitem(sys.modules, "fastapi", None)  # import fastapi now raises ImportError
    res = CliRunner().invoke(cli, ["serve", "--random", "tiny"])
    assert res.exit_code == 1 and "pip install 'sparsegen[serve]'" in res.output
