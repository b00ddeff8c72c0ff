"""`sparsegen generate --chat / --stop / --stop-token-ids` through click's CliRunner (tiny, CPU)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from sparsegen.cli import cli
from sparsegen.models.config import TINY_SPECIAL_TOKENS

pytestmark = pytest.mark.usefixtures("single_thread")
BASE = ["generate", "--random", "tiny", "--device", "cpu", "--json", "--no-warmup", "--ignore-eos"]


def run(*args) -> list[dict]:
    res = CliRunner().invoke(cli, [*BASE, *args], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def test_chat_wraps_the_prompt_in_the_phi3_turn_format():
    (out,) = run("--chat", "--prompt", "Hi", "--max-tokens", "4")
    t = TINY_SPECIAL_TOKENS
    want = [t["<|endoftext|>"], t["<|user|>"], *b"\nHi", t["<|end|>"], *b"\n", t["<|assistant|>"], *b"\n"]
    assert out["prompt_ids"] == want


def test_stop_string_and_stop_token_ids():
    (free,) = run("--prompt", "The quick brown fox", "--max-tokens", "40")
    ids = free["output_ids"]
    j = next(
        j
        for j in range(1, len(ids))
        if all(t < 256 for t in ids[: j + 1]) and all(32 <= t < 127 for t in ids[j - 1 : j + 1])
    )
    stop = bytes(ids[j - 1 : j + 1]).decode()
    upto = bytes(ids[: j + 1]).decode("utf-8", errors="replace")
    (cut,) = run("--prompt", "The quick brown fox", "--max-tokens", "40", "--stop", stop)
    assert cut["finish_reason"] == "stop" and cut["text"] == upto[: upto.find(stop)]
    assert cut["output_ids"] == ids[: len(cut["output_ids"])]
    k = 3
    (tok,) = run("--prompt", "The quick brown fox", "--max-tokens", "40", "--stop-token-ids", f"{ids[k]}")
    assert tok["finish_reason"] == "stop" and tok["output_ids"] == ids[: ids.index(ids[k]) + 1]


@pytest.mark.parametrize(
    "args,msg",
    [(["--chat", "--prompt-ids", "1,2"], "--chat takes text"), (["--prompt", "x", "--stop-token-ids", "a,b"], "--stop-token-ids"),
     (["--prompt", "x", "--stop-token-ids", "99999"], "--stop-token-ids")],
)  # fmt: skip
def test_bad_flags_are_usage_errors(args, msg):
    res = CliRunner().invoke(cli, [*BASE, *args])
    assert res.exit_code == 2 and msg in res.output and "Traceback" not in res.output
