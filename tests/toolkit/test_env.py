"""sparsegen.env, sparsegen.dtypes and sparsegen.errors: one home for small shared facts."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

import sparsegen
from sparsegen import dtypes, env
from sparsegen import errors as errors_mod
from sparsegen.errors import ArchError, EnvError, InputError
from sparsegen.jit import cache

ROOT = Path(sparsegen.__file__).resolve().parent


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " on "])
def test_flag_on(monkeypatch, raw):
    monkeypatch.setenv("SPARSEGEN_DEBUG", raw)
    assert env.flag("SPARSEGEN_DEBUG") is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "no", "OFF", ""])
def test_flag_off(monkeypatch, raw):
    monkeypatch.setenv("SPARSEGEN_DEBUG", raw)
    assert env.flag("SPARSEGEN_DEBUG") is False


def test_flag_unset_is_off(monkeypatch):
    monkeypatch.delenv("SPARSEGEN_POISON_OUTPUT", raising=False)
    assert env.flag("SPARSEGEN_POISON_OUTPUT") is False


@pytest.mark.parametrize("raw", ["2", "enabled", "1.0", "y e s", "nein", "-1"])
def test_flag_garbage_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("SPARSEGEN_DISABLE_JIT", raw)
    with pytest.raises(EnvError, match="SPARSEGEN_DISABLE_JIT"):
        env.flag("SPARSEGEN_DISABLE_JIT")


def test_disable_jit_false_means_enabled(monkeypatch):
    monkeypatch.setenv("SPARSEGEN_DISABLE_JIT", "false")
    assert cache.jit_disabled() is False
    monkeypatch.setenv("SPARSEGEN_DISABLE_JIT", "true")
    assert cache.jit_disabled() is True


def test_unregistered_flag_is_a_programming_error():
    with pytest.raises(KeyError):
        env.flag("SPARSEGEN_NOT_A_FLAG")
    with pytest.raises(KeyError):
        env.flag("SPARSEGEN_CACHE_DIR")  # a path, not a boolean


def test_registry_lists_every_variable_the_code_reads():
    seen = set()
    for path in ROOT.rglob("*.py"):  # the Python reads the environment; templates only render
        seen |= set(re.findall(r"SPARSEGEN_[A-Z][A-Z_]*[A-Z]", path.read_text()))
    missing = seen - set(env.FLAGS)
    assert not missing, f"SPARSEGEN_* variables read but not in env.FLAGS: {sorted(missing)}"
    for spec in env.FLAGS.values():
        assert spec.meaning and spec.default and spec.kind in ("bool", "path", "level", "secret")


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert env.cache_dir() == tmp_path / "explicit"
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", "")
    assert env.cache_dir() == tmp_path / "xdg" / "sparsegen"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says: ignore it
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert env.cache_dir() == tmp_path / "home" / ".cache" / "sparsegen"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert env.cache_dir() == tmp_path / "home" / ".cache" / "sparsegen"
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", "~/kernels")
    assert env.cache_dir() == tmp_path / "home" / "kernels"
    assert cache.cache_dir() == tmp_path / "home" / "kernels"  # the cache resolves through env


def test_log_level(monkeypatch):
    monkeypatch.delenv("SPARSEGEN_LOG_LEVEL", raising=False)
    assert env.log_level() == "INFO"  # unset: INFO, so a cold build says what it compiles (sparsegen.log)
    monkeypatch.setenv("SPARSEGEN_LOG_LEVEL", "debug")
    assert env.log_level() == "DEBUG"
    monkeypatch.setenv("SPARSEGEN_LOG_LEVEL", "loud")
    with pytest.raises(EnvError, match="SPARSEGEN_LOG_LEVEL"):
        env.log_level()


@pytest.mark.parametrize(("arch", "cc"), [("sm_80", 80), ("sm_86", 86), ("sm_89", 89), ("sm_90", 90),
                                          ("sm_90a", 90), ("sm_100", 100), ("sm_120", 120)])  # fmt: skip
def test_parse_arch(arch, cc):
    assert env.parse_arch(arch) == cc


@pytest.mark.parametrize(
    "arch",
    [90, 90.0, True, None, b"sm_90", "", "sm_", "sm_90aa", "sm_90b", "90", "SM_90", "sm90", "sm_9 0",
     "sm_090", "sm_70", "sm_75", "sm_91", "sm_999", "compute_90", "hopper", "sm_٩٠", " sm_90", "sm_90\n"],
)  # fmt: skip
def test_parse_arch_refuses(arch):
    with pytest.raises(ArchError, match="arch"):
        env.parse_arch(arch)
    assert issubclass(ArchError, InputError)


def test_no_gpu_here():
    if torch.cuda.is_available():
        pytest.skip("this test checks the CPU-only answers")
    assert env.current_arch() is None
    assert env.gpu_capable() is False
    assert env.gpu_capable(torch.device("cpu")) is False
    assert env.supports_pdl() is False and env.supports_pdl("cpu") is False
    with pytest.raises(sparsegen.ImplUnavailableError, match="arch="):
        env.resolve_arch(None)
    assert env.resolve_arch("sm_90") == "sm_90"


def test_dtype_table_round_trips():
    for row in dtypes.TABLE:
        assert dtypes.resolve(row.torch) is row
        assert dtypes.resolve(row.name) is row
        assert dtypes.resolve(row.torch_name) is row
        assert getattr(torch, row.torch_name) is row.torch
        assert row.triton_pointer == "*" + row.name
    assert dtypes.resolve(torch.bfloat16).ctype == "__nv_bfloat16"
    assert dtypes.resolve("fp16").ctype == "__half"
    assert dtypes.KERNEL_DTYPES == (torch.float16, torch.bfloat16)


@pytest.mark.parametrize("bad", [torch.float64, torch.int32, "float", "BF16", "", None, 16, object()])
def test_dtype_refuses(bad):
    with pytest.raises(InputError, match="dtype"):
        dtypes.resolve(bad)


def test_kernel_dtypes_refuse_fp32():
    with pytest.raises(InputError, match="fp16"):
        dtypes.resolve(torch.float32, kernel=True)


def test_every_error_class_lives_in_errors_and_is_exported():
    here = {n for n, c in vars(errors_mod).items() if inspect.isclass(c) and issubclass(c, Exception)}
    assert here <= set(sparsegen.__all__)
    for n in here:
        assert getattr(sparsegen, n) is getattr(errors_mod, n)
    # No other module defines an exception class of its own.
    for path in ROOT.rglob("*.py"):
        if path.name == "errors.py":
            continue
        found = re.findall(r"^class (\w+)\((?:[\w.]*Error|Exception)\b", path.read_text(), re.M)
        assert not found, f"{path.relative_to(ROOT)} defines {found}; move it to sparsegen/errors.py"
    # Old import paths still work.
    from sparsegen.engine import CacheOutOfMemory
    from sparsegen.models import CheckpointError
    from sparsegen.tokenizer import TokenizerError

    assert CacheOutOfMemory is sparsegen.CacheOutOfMemory
    assert CheckpointError is sparsegen.CheckpointError
    assert TokenizerError is sparsegen.TokenizerError


def test_pdl_is_off_on_a_cpu_and_a_bad_no_pdl_value_is_an_env_error(monkeypatch):
    """`kernels.fused.add_norm.use_pdl` (programmatic dependent launch of add + LayerNorm): never for a CPU
    tensor; on a GPU it reads SPARSEGEN_NO_PDL, whose garbage values name the variable."""
    from sparsegen.kernels.fused import add_norm as fused

    monkeypatch.setenv("SPARSEGEN_NO_PDL", "0")
    assert fused.use_pdl(torch.zeros(1)) is False
    monkeypatch.setenv("SPARSEGEN_NO_PDL", "maybe")
    with pytest.raises(EnvError, match="SPARSEGEN_NO_PDL"):
        env.flag("SPARSEGEN_NO_PDL")


def test_a_secret_is_read_but_never_reported(monkeypatch):
    from sparsegen.commands.env import _variables

    monkeypatch.setenv("SPARSEGEN_API_KEY", "sk-very-secret")
    assert env.secret("SPARSEGEN_API_KEY") == "sk-very-secret"
    shown = {v["name"]: v["value"] for v in _variables()}
    assert shown["SPARSEGEN_API_KEY"] == "(set)" and "sk-very-secret" not in str(shown)
    monkeypatch.setenv("SPARSEGEN_API_KEY", "")
    assert env.secret("SPARSEGEN_API_KEY") is None
    with pytest.raises(KeyError):
        env.secret("SPARSEGEN_CACHE_DIR")  # a path, not a secret
