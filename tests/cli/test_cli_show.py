"""`sparsegen patterns` and `sparsegen show` through click's CliRunner."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sparsegen.cli import cli


def run(*args):
    return CliRunner().invoke(cli, list(args))


def test_patterns_lists_presets():
    result = run("patterns", "--json")
    assert result.exit_code == 0, result.output
    names = [row["name"] for row in json.loads(result.output)]
    assert names == ["phi3small", "phi3small-128k", "sliding-window", "dense"]
    assert "phi3small" in run("patterns").output


def test_show_json_gives_design_densities():
    result = run("show", "--pattern", "phi3small", "--seq-len", "8192", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["pattern"] == "phi3small" and data["layer"] == 0 and data["seq_len"] == 8192
    dens = [h["density"] for h in data["heads"]]
    expected = [0.3182, 0.3199, 0.3216, 0.3233, 0.3250, 0.3267, 0.3285, 0.3302]
    assert dens[:8] == pytest.approx(expected, abs=1e-4)
    assert [h["kv_head"] for h in data["heads"]] == [h // 4 for h in range(32)]


def test_show_table_and_picture():
    result = run("show", "--pattern", "phi3small", "--seq-len", "2048", "--head", "7")
    assert result.exit_code == 0, result.output
    assert "mean" in result.output and "block mask of head 7" in result.output
    picture = [line for line in result.output.splitlines() if line and set(line) <= set("#. ")]
    assert len(picture) == 32
    assert all(row[0] == "#" for row in picture)  # head 7 always sees block 0


def test_show_dense_layer_and_png(tmp_path):
    png = tmp_path / "mask.png"
    result = run("show", "--pattern", "phi3small", "--layer", "1", "--seq-len", "512", "--png", str(png))
    assert result.exit_code == 0, result.output
    assert "layer 1" in result.output and png.stat().st_size > 1000


@pytest.mark.parametrize(
    "args, message",
    [
        (["show", "--pattern", "nope"], "neither a preset"),
        (["show", "--pattern", "phi3small", "--layer", "32"], "out of range"),
        (["show", "--pattern", "phi3small", "--seq-len", "0"], "seq-len"),
        (["show", "--pattern", "phi3small", "--head", "40"], "head 40"),
        (["show"], "--pattern"),
    ],
)
def test_bad_input_is_one_clean_error(args, message):
    result = run(*args)
    assert result.exit_code == 2
    assert message in result.output
    assert (
        "Traceback" not in result.output
        and result.exception is None
        or isinstance(result.exception, SystemExit)
    )


def test_show_reads_json_spec_and_bad_spec_file(tmp_path):
    from sparsegen import get_pattern

    path = tmp_path / "mine.json"
    path.write_text(get_pattern("sliding-window").to_json())
    assert run("show", "--pattern", str(path), "--seq-len", "100", "--json").exit_code == 0
    path.write_text('{"format": "sparsegen.spec/1", "name": "x", "layers": [{"num_heads": 1}]}')
    result = run("show", "--pattern", str(path))
    assert result.exit_code == 2 and "missing" in result.output
