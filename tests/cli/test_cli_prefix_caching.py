"""`--enable-prefix-caching/--no-enable-prefix-caching` (vLLM's spelling) reach the engine."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import sparsegen.llm
from sparsegen.cli import cli

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize(("flags", "want"), [([], True), (["--no-enable-prefix-caching"], False),
                                             (["--enable-prefix-caching"], True)])  # fmt: skip
def test_generate_passes_the_flag_to_the_engine(monkeypatch, flags, want):
    seen = []
    real = sparsegen.llm.LLM

    def recording(*args, **kw):
        llm = real(*args, **kw)
        seen.append(llm.engine.config.enable_prefix_caching)
        return llm

    monkeypatch.setattr(sparsegen.llm, "LLM", recording)
    args = [
        "generate",
        "--random",
        "tiny",
        "--prompt",
        "hello",
        "--max-tokens",
        "3",
        "--json",
        "--device",
        "cpu",
    ]
    res = CliRunner().invoke(cli, [*args, "--no-warmup", *flags], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert seen == [want]
    assert len(json.loads(res.stdout.splitlines()[0])["output_ids"]) >= 1


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_flag_is_in_help_and_a_bad_spelling_is_a_usage_error(command):
    res = CliRunner().invoke(cli, [command, "--help"])
    assert "--enable-prefix-caching / --no-enable-prefix-caching" in res.output
    bad = CliRunner().invoke(cli, [command, "--random", "tiny", "--enable-prefix-caching=no"])
    assert bad.exit_code == 2
