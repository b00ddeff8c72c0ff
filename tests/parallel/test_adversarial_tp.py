"""Bad tensor-parallel input is a clear, typed error before any rank starts."""

from __future__ import annotations

import json
import multiprocessing

import pytest
import torch
from click.testing import CliRunner
from helpers import extras
from helpers.checkpoint import TINY_HF_CONFIG, random_tensors, write_checkpoint

from sparsegen import DistributedError, InputError
from sparsegen.cli import cli
from sparsegen.engine import LLMEngine
from sparsegen.models import CheckpointError, named_config
from sparsegen.parallel import distributed as D
from sparsegen.parallel.failures import describe, reraise
from sparsegen.parallel.loader import load_tp_checkpoint
from sparsegen.parallel.sharding import TensorParallelPhi3Small, TPShard
from sparsegen.parallel.source import ModelSource


@pytest.mark.parametrize(
    "tp, match",
    [(0, ">= 1"), (-2, ">= 1"), (True, "must be an int"), (2.0, "must be an int"), ("2", "must be an int"),
     (3, "does not divide the model's 8 KV heads"), (16, "does not divide")],
)  # fmt: skip
def test_check_tp_size_rejects(tp, match):
    with pytest.raises(InputError, match=match):
        D.check_tp_size(tp, 8, "cpu")


def test_check_tp_size_counts_gpus():
    assert D.check_tp_size(4, 8, "cuda", device_count=4) == 4
    with pytest.raises(InputError, match="needs 8 GPUs, but 4 are visible"):
        D.check_tp_size(8, 8, "cuda", device_count=4)
    assert D.check_tp_size(8, 8, "cpu") == 8  # processes on a CPU are not limited by devices


@pytest.mark.parametrize("rank, world", [(2, 2), (-1, 2), (0, 0), (True, 2), (0, 1.5)])
def test_bad_shards(rank, world):
    with pytest.raises(InputError, match="TPShard"):
        TPShard(rank, world)


def test_uneven_splits_are_refused():
    with pytest.raises(InputError, match="cannot be split evenly over 3 ranks"):
        TPShard(0, 3).span(8, "KV heads")
    import dataclasses

    odd_ff = dataclasses.replace(named_config("tiny"), ff_intermediate_size=511)
    with pytest.raises(InputError, match="511 GeGeLU units"):
        TensorParallelPhi3Small(odd_ff, TPShard(0, 2))


def test_tensor_parallel_engine_refuses_before_spawning(tmp_path, model):
    before = multiprocessing.active_children()
    with pytest.raises(InputError, match="does not divide the model's 2 KV heads"):
        LLMEngine(ModelSource(random="tiny"), tensor_parallel_size=4, device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="needs 2 GPUs, but 0 are visible"):
            LLMEngine(ModelSource(random="tiny"), tensor_parallel_size=2, device="cuda")
    with pytest.raises(CheckpointError, match="config.json"):
        LLMEngine(ModelSource(model_dir=str(tmp_path / "nowhere")), tensor_parallel_size=2, device="cpu")
    with pytest.raises(InputError, match="tensor_parallel_size must be >= 1, got 0"):
        LLMEngine(ModelSource(random="tiny"), tensor_parallel_size=0, device="cpu")
    with pytest.raises(
        InputError, match=r"collective_timeout_s must be None or a number of seconds in 0\.001\.\.\S+, got 0"
    ):
        LLMEngine(ModelSource(random="tiny"), tensor_parallel_size=2, device="cpu", collective_timeout_s=0)
    with pytest.raises(
        InputError, match="needs a ModelSource"
    ):  # a whole model cannot be split after the fact
        LLMEngine(model, tensor_parallel_size=2)
    with pytest.raises(InputError, match="model must be a Phi3SmallForCausalLM or a ModelSource, got str"):
        LLMEngine("tiny")
    with pytest.raises(InputError, match="device must be cpu or cuda, got 'mps'"):
        LLMEngine(ModelSource(random="tiny"), tensor_parallel_size=2, device="mps")
    assert multiprocessing.active_children() == before


@pytest.fixture(scope="module")
def model():
    from sparsegen.models import random_model

    return random_model("tiny", seed=0)


@pytest.mark.parametrize(
    "kw, match",
    [({}, "exactly one"), ({"random": "tiny", "model_dir": "x"}, "exactly one"),
     ({"random": "tiny", "dtype": "int8"}, "torch dtype"), ({"random": "tiny", "dtype": "nonsense"}, "torch dtype")],
)  # fmt: skip
def test_bad_model_sources(kw, match):
    with pytest.raises(InputError, match=match):
        ModelSource(**kw)


def test_rank_env_is_required(monkeypatch):
    for name in D.ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(DistributedError, match="RANK is not set"):
        D.init_from_env("cpu")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(DistributedError, match="LOCAL_RANK='x' is not an int"):
        D.init_from_env("cpu")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(DistributedError, match="RANK=3 is outside"):
        D.init_from_env("cpu")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(InputError, match="'cuda' or 'cpu'"):
        D.init_from_env("mps")


def test_nvlink_multicast_is_forced_off(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    D.set_nccl_env()
    import os

    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_rank_errors_keep_their_type_or_name_the_rank():
    def failure(exc):
        try:
            raise exc
        except Exception as e:
            return describe(e)

    err = reraise(1, failure(CheckpointError("tensor 'x' is bad")), "")
    assert type(err) is CheckpointError and str(err) == "tensor 'x' is bad"
    err = reraise(1, failure(RuntimeError("CUDA out of memory\nmore")), " (also: rank 0 exited with code 3)")
    assert type(err) is DistributedError
    assert (
        str(err)
        == "tensor-parallel rank 1 failed: RuntimeError: CUDA out of memory (also: rank 0 exited with code 3)"
    )


def _shard_load(folder, **kw):
    return load_tp_checkpoint(folder, TPShard(1, 2), dtype=torch.float32, **kw)


def test_sharded_loading_checks_full_shapes_and_values(tmp_path):
    tensors = random_tensors(TINY_HF_CONFIG)
    name = "model.layers.0.mlp.up_proj.weight"
    bad = dict(tensors, **{name: tensors[name][:-2]})  # one row short of the full shape
    with pytest.raises(CheckpointError, match=r"up_proj.weight.*shape \(1022, 256\).*implies \(1024, 256\)"):
        _shard_load(write_checkpoint(tmp_path / "short", tensors=bad))
    poisoned = dict(tensors, **{name: tensors[name].clone()})
    poisoned[name][-1, 0] = float("nan")  # in rank 1's rows
    with pytest.raises(CheckpointError, match="not finite"):
        _shard_load(write_checkpoint(tmp_path / "nan", tensors=poisoned))
    extra = dict(tensors, **{"model.layers.0.mlp.gate.weight": torch.ones(2)})
    with pytest.raises(CheckpointError, match="no place for"):
        _shard_load(write_checkpoint(tmp_path / "extra", tensors=extra))
    missing = {k: v for k, v in tensors.items() if "final_layernorm.bias" not in k}
    with pytest.raises(CheckpointError, match="lacks tensor 'model.final_layernorm.bias'"):
        _shard_load(write_checkpoint(tmp_path / "missing", tensors=missing))
    untied = write_checkpoint(tmp_path / "untied", cfg=dict(TINY_HF_CONFIG, tie_word_embeddings=False))
    with pytest.raises(CheckpointError, match="tie_word_embeddings=false"):
        _shard_load(untied)


def _gen(*args):
    return CliRunner().invoke(cli, ["generate", *args], catch_exceptions=False)


BAD_TP = [("0", "0 is not in the range"), ("x", "'x' is not a valid integer"), ("1.5", "not a valid integer"),
          ("4", "does not divide the model's 2 KV heads"), ("3", "does not divide")]  # fmt: skip


@pytest.mark.parametrize("tp, match", BAD_TP)
def test_cli_bad_tp_is_a_usage_error(tp, match):
    res = _gen("--random", "tiny", "--prompt-ids", "1,2", "--device", "cpu", "--tp", tp)
    assert res.exit_code == 2, res.output
    assert "--tp" in res.stderr and match in res.stderr
    assert res.stdout == ""


def test_cli_tp_on_a_missing_gpu_is_a_usage_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the check is for a CPU-only one")
    res = _gen("--random", "tiny", "--prompt-ids", "1,2", "--device", "cuda", "--tp", "2")
    assert res.exit_code == 2 and "GPU" in res.stderr


def test_cli_json_still_parses_with_tp_one():
    res = _gen("--random", "tiny", "--prompt-ids", "1,2", "--device", "cpu", "--tp", "1", "--json",
               "--max-tokens", "2", "--no-warmup")  # fmt: skip
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["output_ids"]) == 2


def _serve(*args):
    return CliRunner().invoke(cli, ["serve", *args], catch_exceptions=False)


@pytest.mark.parametrize("tp, match", [*BAD_TP, ("-1", "not in the range")])
def test_cli_serve_bad_tp_is_a_usage_error_before_anything_starts(tp, match):
    extras.require("fastapi")
    before = multiprocessing.active_children()
    res = _serve("--random", "tiny", "--device", "cpu", "--port", "0", "--tp", tp)
    assert res.exit_code == 2, res.output
    assert "--tp" in res.stderr and match in res.stderr and "Traceback" not in res.output
    assert multiprocessing.active_children() == before  # no rank was started


def test_cli_serve_tp_on_a_missing_gpu_is_a_usage_error():
    extras.require("fastapi")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the check is for a CPU-only one")
    res = _serve("--random", "tiny", "--device", "cuda", "--port", "0", "--tp", "2")
    assert res.exit_code == 2 and "GPU" in res.stderr and "Traceback" not in res.output


@pytest.mark.parametrize(
    "tp, match", [(True, "must be an int"), (1.0, "must be an int"), (0, ">= 1"), (4, "2 KV heads")]
)
def test_llm_bad_tensor_parallel_size_is_refused_before_any_rank(tp, match):
    from sparsegen import LLM

    before = multiprocessing.active_children()
    with pytest.raises(InputError, match=match):
        LLM(random="tiny", device="cpu", tensor_parallel_size=tp)
    assert multiprocessing.active_children() == before
