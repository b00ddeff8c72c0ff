"""The small ones, each with its siblings: sparsegen.flex's arguments, LLM's seed, and every float
option of every command (NaN and infinities are usage errors, exit 2, naming the option)."""

from __future__ import annotations

import click
import pytest
import torch
from click.testing import CliRunner

import sparsegen as sg
from sparsegen import flex
from sparsegen.cli import COMMANDS, cli
from sparsegen.errors import InputError

LAYER = sg.get_pattern("phi3small").layers[0]
NO_GPU = not torch.cuda.is_available()

FLEX_BAD = [
    ((LAYER, None), {}, "n_q"),
    ((LAYER, None, None), {}, "n_q"),
    ((LAYER, None, 8), {}, "n_q"),
    ((LAYER, 2**40), {}, "n_q"),
    ((LAYER, 4, 2**40), {}, "n_k"),
    ((LAYER, 4, 8), {"device": "nonsense"}, "device"),
    ((LAYER, 4, 8), {"device": "cuda:x"}, "device"),
    ((LAYER, 4, 8), {"device": 3.5}, "device"),
    ((LAYER, 4, 8), {"device": ["cpu"]}, "device"),
    ((LAYER, 4, 8), {"device": "meta"}, "device"),
    ((LAYER, 4, 8), {"device": "cuda:99"}, "device"),
]
if NO_GPU:
    FLEX_BAD.append(((LAYER, 4, 8), {"device": "cuda"}, "device"))


@pytest.mark.parametrize("args,kwargs,field", FLEX_BAD, ids=[f"{a[1:]}-{k}" for a, k, _ in FLEX_BAD])
def test_flex_arguments_are_input_errors(args, kwargs, field):
    with pytest.raises(InputError, match=field):
        flex.mask_mod(*args, **kwargs)
    with pytest.raises(InputError, match=field):
        flex.block_mask(*args, **kwargs)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"block_size": None}, "block_size"),
        ({"block_size": "64"}, "block_size"),
        ({"compile": "yes"}, "compile"),
    ],
)
def test_flex_block_mask_options_are_input_errors(kwargs, field):
    with pytest.raises(InputError, match=field):
        flex.block_mask(LAYER, 4, 8, **kwargs)


def test_flex_still_takes_what_it_took():
    a = flex.block_mask(LAYER, 64, 128, block_size=[64, 64], device=torch.device("cpu"))
    b = flex.block_mask(LAYER, 64, 128, block_size=(64, 64))
    assert a.to_dense().equal(b.to_dense())
    mod = flex.mask_mod(LAYER, 8, device=None)
    assert bool(mod(0, 0, torch.tensor(7), torch.tensor(0)))


@pytest.mark.parametrize("seed", ["1", -1, 2**64, True, 1.5, None])
def test_llm_seed_is_checked(seed):
    with pytest.raises(InputError, match="seed"):
        sg.LLM(random="tiny", seed=seed)


def test_llm_force_dense_is_checked():
    with pytest.raises(InputError, match="force_dense"):
        sg.LLM(random="tiny", force_dense="no")


# -- every float option of every command --------------------------------------------------------------
def _float_options() -> list[tuple[list[str], str]]:
    ctx = click.Context(cli)
    found = []

    def walk(cmd, path):
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, [*path, name])
        found.extend((path, p.opts[0]) for p in cmd.params if isinstance(p.type, click.types.FloatParamType))

    for name in COMMANDS:
        walk(cli.get_command(ctx, name), [name])
    return found


FLOATS = _float_options()
CASES = [(c, o, v) for c, o in FLOATS for v in ("nan", "NaN", "inf", "-inf", "infinity")]


def test_the_float_options_are_found():
    opts = {(" ".join(c), o) for c, o in FLOATS}
    assert {
        ("cache sweep", "--older-than"),
        ("serve", "--drain-timeout"),
        ("generate", "--temperature"),
    } <= opts


@pytest.mark.parametrize("path,option,value", CASES, ids=[f"{' '.join(c)} {o} {v}" for c, o, v in CASES])
def test_every_float_option_refuses_non_finite_values_with_exit_2(path, option, value):
    res = CliRunner().invoke(cli, [*path, option, value])
    assert res.exit_code == 2, res.output
    assert option in res.stderr and res.stderr.count("\n") == 1, res.stderr


def test_cache_sweep_still_sweeps(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    monkeypatch.setenv("SPARSEGEN_CACHE_DIR", str(cache))
    res = CliRunner().invoke(cli, ["cache", "sweep", "--older-than", "0"])
    assert res.exit_code == 0 and "removed 0 leftovers" in res.stdout, res.output
