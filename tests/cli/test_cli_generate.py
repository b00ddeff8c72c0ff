"""`sparsegen generate` through click's CliRunner, on the CPU path."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from helpers.checkpoint import TINY_HF_CONFIG, random_tensors, write_bpe_file, write_checkpoint

from sparsegen.cli import cli

pytestmark = pytest.mark.usefixtures("single_thread")


def run(*args):
    return CliRunner().invoke(cli, ["generate", *args], catch_exceptions=False)


def test_random_tiny_json_lines_in_input_order():
    res = run("--random", "tiny", "--prompt", "hello", "--prompt-ids", "1,2,3", "--prompt", "bye", "--max-tokens", "6",
              "--json", "--device", "cpu")  # fmt: skip
    assert res.exit_code == 0, res.output
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [x["prompt_ids"] for x in lines] == [list(b"hello"), list(b"bye"), [1, 2, 3]]
    for x in lines:
        assert set(x) == {
            "prompt_ids",
            "output_ids",
            "text",
            "finish_reason",
            "ttft_s",
            "decode_tokens_per_s",
        }
        assert x["finish_reason"] in ("eos", "stop", "length")
        assert 1 <= len(x["output_ids"]) <= 6 and x["ttft_s"] >= 0
        if x["finish_reason"] == "length":
            assert len(x["output_ids"]) == 6


def test_streams_text_and_reports_speed():
    res = run("--random", "tiny", "--prompt", "hello", "--max-tokens", "8")
    assert res.exit_code == 0, res.output
    # stdout holds the text only; the statistics are messages, on stderr
    assert "tokens/s" not in res.stdout and "warm-up" not in res.stdout
    assert "tokens/s" in res.stderr and "time to first token" in res.stderr
    assert "warm-up (kernel builds" in res.stderr


def test_greedy_is_deterministic_and_force_dense_runs(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox " * 12 + "\n\nsecond line\n")
    common = [
        "--random",
        "tiny",
        "--prompts-file",
        str(prompts),
        "--max-tokens",
        "5",
        "--json",
        "--ignore-eos",
    ]
    a, b = run(*common), run(*common)
    assert a.exit_code == b.exit_code == 0, a.output
    ids_a = [json.loads(x)["output_ids"] for x in a.stdout.splitlines()]
    ids_b = [json.loads(x)["output_ids"] for x in b.stdout.splitlines()]
    assert ids_a == ids_b and len(ids_a) == 2
    dense = run(*common, "--force-dense")
    assert dense.exit_code == 0 and len(dense.stdout.splitlines()) == 2


def test_sampling_options_with_seed():
    common = ["--random", "tiny", "--prompt", "abc", "--max-tokens", "8", "--json", "--ignore-eos",
              "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "3"]  # fmt: skip
    a, b = run(*common), run(*common)
    assert a.exit_code == 0
    assert json.loads(a.stdout)["output_ids"] == json.loads(b.stdout)["output_ids"]


def test_model_folder_with_tokenizer(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt", tensors=random_tensors(TINY_HF_CONFIG, with_lm_head=True))
    res = run("--model", str(folder), "--prompt-ids", "5,6,7,8", "--max-tokens", "4", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["prompt_ids"] == [5, 6, 7, 8]
    res = run("--model", str(folder), "--prompt", "hi")
    assert res.exit_code == 2 and "no .tiktoken file" in res.output
    write_bpe_file(folder / "tokenizer.tiktoken")  # 264 ranks + 5 specials fit the 272-id vocabulary
    res = run("--model", str(folder), "--prompt", "hello world", "--max-tokens", "3", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["prompt_ids"] == [259, 263]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--prompt", "x"], "exactly one of --model DIR or --random"),
        (["--random", "tiny", "--model", "/tmp", "--prompt", "x"], "exactly one of"),
        (["--random", "tiny"], "at least one --prompt"),
        (["--random", "tiny", "--prompt-ids", "1,x"], "not a comma-separated list"),
        (["--random", "tiny", "--prompt-ids", "1,999"], "outside the vocabulary"),
        (["--random", "huge", "--prompt", "x"], "'huge' is not one of"),
        (["--random", "tiny", "--prompt", "x", "--top-p", "0"], "--top-p"),
        (["--model", "/nonexistent/ckpt", "--prompt-ids", "1"], "does not exist"),
        (["--random", "tiny", "--prompt", "x", "--device", "cuda:0"], "no CUDA GPU"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message):
    import torch

    if "cuda:0" in args and torch.cuda.is_available():
        pytest.skip("a GPU is present")
    res = run(*args)
    assert res.exit_code == 2
    assert message in res.output
    assert "Traceback" not in res.output


def test_broken_checkpoint_is_a_clean_error(tmp_path):
    folder = write_checkpoint(tmp_path / "ckpt")
    (folder / "model.safetensors").write_bytes(b"junk")
    res = run("--model", str(folder), "--prompt-ids", "1")
    assert res.exit_code == 2 and "model.safetensors" in res.output
