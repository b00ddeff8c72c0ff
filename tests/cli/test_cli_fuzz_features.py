"""`sparsegen fuzz --features`: random specs with the attention features, prefill in the interpreter."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from helpers.interpreter import run_in_interpreter

from sparsegen.cli import cli
from sparsegen.testing_features import sample_feature_layers


def test_feature_specs_are_drawn_reproducibly_and_use_the_features():
    layers = sample_feature_layers(1, 6, False)
    assert layers == sample_feature_layers(1, 6, False)
    assert {f for ly in layers for f in ly.features} == {"sink_tokens", "logit_softcap", "learned_sinks"}
    assert {ly.head_dim for ly in layers} <= {32, 48, 80}


@pytest.mark.parametrize("args", [["--pattern", "phi3small"], ["--random", "--kernel", "decode"]])
def test_features_needs_random_prefill(args):
    result = CliRunner().invoke(cli, ["fuzz", "--features", *args])
    assert result.exit_code != 0
    assert "--features needs --random and --kernel prefill" in result.output


@pytest.mark.slow
def test_fuzz_features_on_cpu():
    run = run_in_interpreter("-m", "sparsegen.cli", "fuzz", "--random", "--features", "--kernel", "prefill",
                             "--specs", "3", "--examples", "3", "--max-len", "80", "--seed", "1")  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "prefill: 9 cases over 3 spec(s), 0 failed" in run.stdout
