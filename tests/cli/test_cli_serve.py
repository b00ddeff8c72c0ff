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
        # vLLM's spellings
        (["/nonexistent/dir"], "MODEL"),
        ([".", "--random", "tiny"], "exactly one of"),
        ([".", "--model", "/"], "given twice and differently"),
        (["--random", "tiny", "--tp", "2", "--tensor-parallel-size", "3"], "disagree"),
        (["--random", "tiny", "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["--random", "tiny", "--dtype", "bf8"], "--dtype"),
        (["--random", "tiny", "--seed", "-1"], "--seed"),
        (["--random", "tiny", "--chat-template", "/nonexistent/t.jinja"], "--chat-template"),
        (["--random", "tiny", "--chat-template", "{% for %}", "--no-warmup"], "--chat-template"),
        (["--random", "tiny", "--api-key", " padded "], "--api-key"),
        (["--random", "tiny", "--api-key", ""], "--api-key"),
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


def test_vllm_spellings_reach_the_llm_and_the_server(monkeypatch, tmp_path):
    """`serve DIR --dtype bfloat16 --tensor-parallel-size 1 --enforce-eager --seed 7 --chat-template
    FILE --api-key K --strict`: what LLM and serve() are given (serve() is recorded, not run)."""
    import sparsegen.llm
    import sparsegen.serve.server

    real_llm, made, served = sparsegen.llm.LLM, {}, {}

    def recording_llm(**kwargs):
        made.update(kwargs)
        return real_llm(**kwargs)

    def recording_serve(llm, host, port, **kwargs):
        served.update(kwargs, llm=llm)

    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    monkeypatch.setattr(sparsegen.llm, "LLM", recording_llm)
    monkeypatch.setattr(sparsegen.serve.server, "serve", recording_serve)
    monkeypatch.delenv("SPARSEGEN_API_KEY", raising=False)
    args = ["serve", "--random", "tiny", "--no-warmup", "--device", "cpu", "--dtype", "float32",
            "--tensor-parallel-size", "1", "--enforce-eager", "--seed", "7",
            "--chat-template", str(template), "--api-key", "k1", "--strict"]  # fmt: skip
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    assert made["dtype"] == "float32" and made["seed"] == 7 and made["tensor_parallel_size"] == 1
    assert made["use_cuda_graphs"] is False
    assert served["api_key"] == "k1" and served["strict"] is True
    rendered = served["llm"].chat_template.render([{"role": "developer", "content": "x"}], False)
    assert rendered == "[system]x"


def test_api_key_from_the_environment_and_dtype_auto(monkeypatch):
    import sparsegen.llm
    import sparsegen.serve.server

    real_llm, made, served = sparsegen.llm.LLM, {}, {}
    monkeypatch.setattr(sparsegen.llm, "LLM", lambda **kw: made.update(kw) or real_llm(**kw))
    monkeypatch.setattr(sparsegen.serve.server, "serve", lambda llm, h, p, **kw: served.update(kw))
    monkeypatch.setenv("SPARSEGEN_API_KEY", "from-env")
    res = CliRunner().invoke(
        cli, ["serve", "--random", "tiny", "--no-warmup", "--device", "cpu", "--dtype", "auto"]
    )
    assert res.exit_code == 0, res.output
    assert served["api_key"] == "from-env" and served["strict"] is False and made["dtype"] is None
