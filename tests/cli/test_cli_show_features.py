"""`sparsegen show` states a layer's attention features and its prefill kernel variant."""

from __future__ import annotations

import json

from click.testing import CliRunner

from sparsegen.cli import cli

GEMMA2 = {"model_type": "gemma2", "num_hidden_layers": 4, "hidden_size": 2304, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 256}  # fmt: skip
GPT_OSS = {"model_type": "gpt_oss", "num_hidden_layers": 4, "hidden_size": 2880, "num_attention_heads": 64,
           "num_key_value_heads": 8, "head_dim": 64}  # fmt: skip


def _show(tmp_path, cfg, *extra):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = CliRunner().invoke(cli, ["show", "--pattern", str(tmp_path), "--seq-len", "256", *extra])
    assert result.exit_code == 0, result.output
    return result.output


def test_gemma2_softcap_scale_and_gluon(tmp_path):
    out = _show(tmp_path, GEMMA2)
    assert "soft-cap 50.0, learned sinks off, scale 0.0625 (the layer)" in out
    assert "prefill kernel on sm_90: gluon\n" in out


def test_padded_and_tl_head_dims(tmp_path):
    (tmp_path / "a").mkdir()
    out = _show(tmp_path / "a", {**GEMMA2, "head_dim": 160})
    assert "prefill kernel on sm_90: gluon (head_dim 160 in 256-wide tiles)" in out
    (tmp_path / "b").mkdir()
    out = _show(tmp_path / "b", {**GEMMA2, "head_dim": 32})
    assert (
        "prefill kernel on sm_90: tl (Gluon does not cover head_dim 32 (the Gluon kernel covers 48..256)"
        in out
    )


def test_gpt_oss_learned_sinks_json(tmp_path):
    data = json.loads(_show(tmp_path, GPT_OSS, "--json"))
    assert data["learned_sinks"] is True and data["logit_softcap"] == 0.0
    assert data["scale"] == 64**-0.5
    assert data["prefill_sm90"] == "gluon"


def test_phi3small_gets_gluon():
    result = CliRunner().invoke(cli, ["show", "--pattern", "phi3small", "--seq-len", "256"])
    assert "prefill kernel on sm_90: gluon" in result.output
    assert "sink tokens per head: none" in result.output
