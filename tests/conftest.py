"""Shared pytest set-up: hypothesis profiles, the gpu marker, a private kernel cache, and the
fixtures many test folders use (the tiny model, one torch thread, a fresh cache, the interpreter)."""

from __future__ import annotations

import os
import random

import pytest
import torch
from hypothesis import HealthCheck, settings

# Every profile names derandomize: a profile inherits what it leaves out from the one loaded
# when it is registered, and under CI=true hypothesis has loaded its own derandomized "ci" profile.
settings.register_profile(
    "default",
    deadline=None,
    max_examples=25,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)
# CI draws fresh examples each run from one seed chosen per run (printed at the end of the run;
# --hypothesis-seed=N repeats it, and a failure also prints its @reproduce_failure blob);
# "ci-derandomized" is the fixed-examples run.
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=25,
    derandomize=False,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci-derandomized",
    deadline=None,
    max_examples=25,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "gpu",
    deadline=None,
    max_examples=150,
    derandomize=False,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))


HAS_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0)


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU of sm_80 or newer; run `pytest -m gpu` on one")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_HYPOTHESIS_SEED = pytest.StashKey[object]()


@pytest.hookimpl(trylast=True)
def pytest_configure(config):
    """Outside a derandomized profile, every run draws hypothesis examples from one fresh seed
    (unless --hypothesis-seed gave one), so that the seed can be printed and a failure repeated."""
    from hypothesis import core

    if core.global_force_seed is None and not settings.default.derandomize:
        core.global_force_seed = random.SystemRandom().randrange(2**32)
    config.stash[_HYPOTHESIS_SEED] = core.global_force_seed


def pytest_terminal_summary(terminalreporter, config):
    """The random order's and hypothesis' seeds, even under -q (pytest-randomly prints its own only
    in the header)."""
    hseed = config.stash.get(_HYPOTHESIS_SEED, None)
    if hseed is not None:
        terminalreporter.write_line(f"hypothesis examples: --hypothesis-seed={hseed} repeats them")
    seed = getattr(config.option, "randomly_seed", None)
    if seed is not None and config.pluginmanager.has_plugin("randomly"):
        terminalreporter.write_line(
            f"random test order: --randomly-seed={seed} repeats it; -p no:randomly turns it off"
        )


@pytest.fixture(autouse=True, scope="session")
def _private_cache_dir(tmp_path_factory):
    """Every test session compiles into its own cache unless SPARSEGEN_CACHE_DIR is set."""
    if "SPARSEGEN_CACHE_DIR" not in os.environ:
        path = tmp_path_factory.mktemp("sparsegen-cache")
        path.chmod(0o700)
        os.environ["SPARSEGEN_CACHE_DIR"] = str(path)
    yield


@pytest.fixture(scope="module")
def model():
    """The tiny random Phi-3-Small with the reference attention, on the CPU (one per test module;
    a module may define its own `model` instead)."""
    from sparsegen.models import random_model

    return random_model("tiny", seed=0, attn_impl="reference")


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty private kernel cache for one test, with this process's kernel memos dropped."""
    from sparsegen.kernels import decode as decode_mod
    from sparsegen.kernels import prefill as prefill_mod

    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(root))
    monkeypatch.setenv("SPARSEGEN_QUIET", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("SPARSEGEN_DISABLE_JIT", raising=False)
    prefill_mod.forget()
    decode_mod.forget()
    yield root
    prefill_mod.forget()
    decode_mod.forget()


@pytest.fixture(scope="module")
def single_thread():
    """Tiny-model tests are latency bound: one intra-op thread avoids oversubscribing CI cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def interpreter_env(monkeypatch):
    """For the interpreter case files: the interpreter flag (and quiet logs) for every case."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("SPARSEGEN_QUIET", "1")
