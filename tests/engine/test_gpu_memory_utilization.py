"""`gpu_memory_utilization` (vLLM's meaning: the share of the whole GPU the engine may take for
its weights, KV cache and a step's activations): the budget's arithmetic, the KV pages it gives a
GPU model (the CUDA memory calls stubbed: no GPU here), its checks, and `serve
--gpu-memory-utilization`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner

from sparsegen.cli import cli
from sparsegen.errors import InputError, MemoryLimitError
from sparsegen.models import random_model
from sparsegen.models.memory import gpu_cache_bytes
from sparsegen.runner import model_runner
from sparsegen.runner.config import EngineConfig

GIB = 1 << 30


def test_the_share_less_what_the_engine_holds_and_the_headroom():
    # an idle 141 GiB GPU, 14 GiB of weights loaded: 0.9 of it is 126.9 GiB for everything
    got = gpu_cache_bytes(free=127 * GIB, total=141 * GIB, held=14 * GIB, headroom=6 * GIB, utilization=0.9)
    assert got == int(141 * GIB * 0.9) - 14 * GIB - 6 * GIB
    # a smaller share is a smaller cache, by exactly the difference
    half = gpu_cache_bytes(127 * GIB, 141 * GIB, 14 * GIB, 6 * GIB, 0.5)
    assert got - half == int(141 * GIB * 0.9) - int(141 * GIB * 0.5)
    # the whole GPU, nothing held by anyone else
    assert gpu_cache_bytes(100 * GIB, 100 * GIB, 0, GIB, 1.0) == 99 * GIB


def test_other_processes_leave_less_than_the_share():
    # 60 GiB held elsewhere: 0.9 of 141 GiB cannot be had
    with pytest.raises(MemoryLimitError, match=r"gpu_memory_utilization=0.9 asks for 126.9 GiB"):
        gpu_cache_bytes(free=67 * GIB, total=141 * GIB, held=14 * GIB, headroom=6 * GIB, utilization=0.9)
    # the same GPU at 0.5 (70.5 GiB <= 67 free + 14 held) fits
    assert gpu_cache_bytes(67 * GIB, 141 * GIB, 14 * GIB, 6 * GIB, 0.5) == int(141 * GIB * 0.5) - 20 * GIB


def test_no_room_left_for_a_cache_is_an_error():
    with pytest.raises(MemoryLimitError, match="leaves no room for a KV cache"):
        gpu_cache_bytes(free=127 * GIB, total=141 * GIB, held=14 * GIB, headroom=6 * GIB, utilization=0.1)


def _fake_gpu_model():
    model = random_model("tiny", seed=0, attn_impl="reference")
    return SimpleNamespace(config=model.config, dtype=torch.bfloat16, device=torch.device("cuda", 0),
                           local_num_kv_heads=model.config.num_key_value_heads)  # fmt: skip


def test_default_num_pages_follows_the_utilization(monkeypatch):
    model = _fake_gpu_model()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (120 * GIB, 141 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 3 * GIB)
    per_page = model_runner.kv_bytes_per_page(model, 16)
    headroom = max(model_runner.GPU_MIN_HEADROOM_BYTES,
                   model_runner.step_activation_bytes(model, 256) + model_runner.GPU_OVERHEAD_BYTES)  # fmt: skip
    for u in (0.3, 0.6, 0.85):
        got = model_runner.default_num_pages(model, 16, None, 256, gpu_memory_utilization=u)
        assert got == (int(141 * GIB * u) - 3 * GIB - headroom) // per_page
    with pytest.raises(MemoryLimitError, match="other processes hold the rest"):  # 18 GiB used elsewhere
        model_runner.default_num_pages(model, 16, None, 256, gpu_memory_utilization=0.95)
    # without it, the default rule (90 % of the free memory less the headroom) is unchanged
    assert (
        model_runner.default_num_pages(model, 16, None, 256) == (int(120 * GIB * 0.9) - headroom) // per_page
    )
    # a given size wins over the utilization
    assert model_runner.default_num_pages(model, 16, 10 * per_page, 256, gpu_memory_utilization=0.3) == 10


def test_the_cpu_cache_ignores_it():
    model = random_model("tiny", seed=0, attn_impl="reference")
    per_page = model_runner.kv_bytes_per_page(model, 16)
    got = model_runner.default_num_pages(model, 16, None, 256, gpu_memory_utilization=0.01)
    assert got == model_runner.CPU_KV_CACHE_BYTES // per_page


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, float("nan"), float("inf"), True, "0.9"])
def test_engine_config_checks_it(bad):
    with pytest.raises(InputError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=bad)


@pytest.mark.parametrize("good", [None, 1, 0.5, 1e-3])
def test_engine_config_takes_it(good):
    assert EngineConfig(gpu_memory_utilization=good).gpu_memory_utilization == good


@pytest.mark.parametrize("bad", ["0", "1.5", "-1", "x"])
def test_serve_flag_range(bad):
    res = CliRunner().invoke(cli, ["serve", "--random", "tiny", "--gpu-memory-utilization", bad])
    assert res.exit_code == 2 and "--gpu-memory-utilization" in res.output


def test_serve_flag_reaches_the_engine(monkeypatch):
    import sparsegen.llm
    import sparsegen.serve.server

    real_llm, made = sparsegen.llm.LLM, {}
    monkeypatch.setattr(sparsegen.llm, "LLM", lambda **kw: made.update(kw) or real_llm(**kw))
    monkeypatch.setattr(
        sparsegen.serve.server, "serve", lambda llm, h, p, **kw: made.update(engine=llm.engine)
    )
    res = CliRunner().invoke(
        cli,
        ["serve", "--random", "tiny", "--no-warmup", "--device", "cpu", "--gpu-memory-utilization", "0.75"],
    )
    assert res.exit_code == 0, res.output
    assert made["gpu_memory_utilization"] == 0.75
    assert made["engine"].config.gpu_memory_utilization == 0.75
