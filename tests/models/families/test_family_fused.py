"""The families' fused weights and their kernel plan: q/k/v and gate/up are loaded into one
parameter each by their checkpoint names (`models.families.fused`), a permutation of rows that
computes every output exactly as the separate projection does in float32; a wrong tensor is
still refused by its own name; the kernels a family launches are listed ahead of time
(`models.kernel_plan`) and `sparsegen compile --model-kernels` takes a family's config.json;
`dense_attention` forces every layer dense with its features kept."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.extras import require
from helpers.hf_families import FAMILY_CASES, write_family_checkpoint
from safetensors.torch import load_file, save_file

from sparsegen.engine import LLMEngine, SamplingParams
from sparsegen.errors import CheckpointError, InputError
from sparsegen.kernels.family import registered
from sparsegen.models import load_checkpoint
from sparsegen.models.families import random_config
from sparsegen.models.families.fused import gate_up_rows, qkv_rows
from sparsegen.models.kernel_plan import model_kernel_requests
from sparsegen.runner.config import EngineConfig

require("transformers")
pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        f: write_family_checkpoint(tmp_path_factory.mktemp(f) / "ckpt", f)[0] for f in sorted(FAMILY_CASES)
    }


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 8), (8, 8, 4), (6, 1, 2), (1, 1, 16)])
def test_fused_rows_are_a_permutation_in_the_grouped_layout(heads, kv_heads, head_dim):
    q, k, v = qkv_rows(heads, kv_heads, head_dim)
    rows = torch.cat((q, k, v))
    assert torch.equal(rows.sort().values, torch.arange((heads + 2 * kv_heads) * head_dim))
    g = heads // kv_heads
    # query head i = j g + r sits in slot j (g + 2) + r; key j at j (g + 2) + g; value after it
    for i in range(heads):
        j, r = divmod(i, g)
        assert q[i * head_dim] == (j * (g + 2) + r) * head_dim
    assert k[0] == g * head_dim and v[0] == (g + 1) * head_dim
    gate, up = gate_up_rows(5)
    assert gate.tolist() == [0, 2, 4, 6, 8] and up.tolist() == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("family", sorted(FAMILY_CASES))
def test_fused_projections_equal_the_checkpoint_tensors_exactly(checkpoints, family):
    folder = checkpoints[family]
    tensors = load_file(str(folder / "model.safetensors"))
    model = load_checkpoint(folder, dtype=torch.float32)
    x = torch.randn(20, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    for i, block in enumerate(model.model.layers):
        a, pre = block.self_attn, f"model.layers.{i}."

        def lin(name, pre=pre):
            return F.linear(x, tensors[pre + name + ".weight"], tensors.get(pre + name + ".bias"))

        qkv = a.qkv_proj(x).view(20, a.num_kv_heads, a.group + 2, a.head_dim)  # [T, Hkv, G + 2, D]
        grouped = (20, a.num_kv_heads, -1, a.head_dim)
        assert torch.equal(qkv[:, :, : a.group], lin("self_attn.q_proj").view(grouped))
        assert torch.equal(qkv[:, :, a.group :], torch.stack(
            (lin("self_attn.k_proj").view(grouped)[:, :, 0], lin("self_attn.v_proj").view(grouped)[:, :, 0]), 2))  # fmt: skip
        assert torch.equal(a.o_proj.weight, tensors[pre + "self_attn.o_proj.weight"])
        if not model.config.num_experts:
            gate_up = block.mlp.gate_up_proj(x)  # [T, 2F]
            assert torch.equal(gate_up[:, 0::2], lin("mlp.gate_proj"))
            assert torch.equal(gate_up[:, 1::2], lin("mlp.up_proj"))
        if model.config.qk_norm:
            assert torch.equal(a.q_norm.weight, tensors[pre + "self_attn.q_norm.weight"])
        if model.config.sinks:
            assert torch.equal(a.sinks, tensors[pre + "self_attn.sinks"])


@pytest.mark.parametrize(
    "name,edit,message",
    [
        ("model.layers.0.self_attn.k_proj.weight", lambda t: t[:-1], r"k_proj.weight' .* has shape"),
        ("model.layers.1.mlp.up_proj.weight", None, "lacks tensor 'model.layers.1.mlp.up_proj.weight'"),
        ("model.layers.0.self_attn.q_proj.bias", lambda t: t * float("nan"), "q_proj.bias' .* not finite"),
    ],
)
def test_a_bad_or_missing_split_tensor_is_named(checkpoints, tmp_path, name, edit, message):
    src = checkpoints["qwen2"]
    tensors = load_file(str(src / "model.safetensors"))
    if edit is None:
        tensors.pop(name)
    else:
        tensors[name] = edit(tensors[name]).contiguous()
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(tmp_path, dtype=torch.float32)


def _name(request) -> str:
    """The readable name a model-kernel request is cached under (its family's `describe`)."""
    return registered(request.kind, request.variant).name(request)


@pytest.mark.parametrize("name", ["mistral-7b", "llama3-8b", "qwen2-7b", "gemma2-9b", "gpt-oss-20b"])
def test_family_kernel_plan(name):
    cfg = random_config(name)
    reqs = model_kernel_requests(cfg, torch.bfloat16, "sm_90")
    kinds = {r.kind for r in reqs}
    assert {"gemv", "add_norm", "rotary_kv_write"} <= kinds and "gegelu" not in kinds
    assert len(set(reqs)) == len(reqs)
    names = " ".join(_name(r) for r in reqs if r.kind in ("gemv", "add_norm"))
    assert ("rms1p" in names) == (cfg.norm_offset == 1.0) and "rms" in names
    assert ("swiglu" in names) == (cfg.act == "silu" and not cfg.num_experts)
    assert ("geglu" in names) == (cfg.act == "gelu_tanh")
    # gemm_rows exists for the weight shapes ROWS_LAYERS lists (Mistral's and Llama-3's are the
    # 7b Phi-3-Small's), on Hopper only
    assert ("gemm_rows" in kinds) == (name in ("mistral-7b", "llama3-8b"))
    assert not any(r.kind == "gemm_rows" for r in model_kernel_requests(cfg, torch.bfloat16, "sm_80"))


def test_qk_norm_families_plan_no_rotary_gemv(checkpoints):
    from sparsegen.models.families import config_from_file

    qwen3 = config_from_file(checkpoints["qwen3"] / "config.json")
    llama = config_from_file(checkpoints["llama"] / "config.json")
    rope = lambda c: [r for r in model_kernel_requests(c, torch.bfloat16, "sm_90") if "rope" in _name(r)]  # noqa: E731
    assert rope(llama) and not rope(qwen3)


@pytest.mark.slow
def test_compile_model_kernels_takes_a_family_config(checkpoints, fresh_cache):
    from click.testing import CliRunner

    from sparsegen.cli import cli

    cfg = checkpoints["gemma2"] / "config.json"
    run = CliRunner().invoke(cli, ["compile", "--pattern", str(cfg), "--model-kernels", "--kind", "decode",
                                   "--arch", "sm_90", "--json"])  # fmt: skip
    assert run.exit_code == 0, run.output
    records = json.loads(run.stdout)
    kinds = {r["kind"] for r in records}
    assert {"gemv", "add_norm", "rotary_kv_write", "decode"} <= kinds
    assert all(r["status"] in ("compiled", "cached") for r in records)


def test_dense_attention_forces_every_layer_dense_with_features_kept(checkpoints):
    model = load_checkpoint(checkpoints["gpt_oss"], dtype=torch.float32)
    own = model.spec
    engine = LLMEngine(model, dense_attention=True)
    assert engine.config.dense_attention
    assert all(layer.is_dense for layer in model.spec.layers) and not all(
        layer.is_dense for layer in own.layers
    )
    for dense, layer in zip(model.spec.layers, own.layers, strict=True):
        assert (dense.learned_sinks, dense.logit_softcap, dense.scale) == (
            layer.learned_sinks, layer.logit_softcap, layer.scale)  # fmt: skip
    prompt = [(7 * i + 3) % 90 + 1 for i in range(20)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    forced = engine.generate([prompt], params)[0].token_ids
    reference = load_checkpoint(checkpoints["gpt_oss"], dtype=torch.float32, force_dense=True)
    assert forced == LLMEngine(reference).generate([prompt], params)[0].token_ids
    with pytest.raises(InputError, match="dense_attention must be a bool"):
        EngineConfig(dense_attention=1)


@pytest.mark.parametrize("tokens", [1, 2, 7])
def test_moe_static_routing_equals_the_routed_loop(checkpoints, tokens):
    """The mixture with no host read of the routing (what a CUDA graph or torch.compile runs):
    the gathered experts (few tokens) and the every-expert sum both equal the host-routed loop."""
    model = load_checkpoint(checkpoints["gpt_oss"], dtype=torch.float32)
    moe = model.model.layers[0].mlp
    x = torch.randn(tokens, model.config.hidden_size, generator=torch.Generator().manual_seed(tokens))
    want = moe(x)  # on a CPU: the loop over the experts the tokens route to
    top, idx = torch.topk(moe.router(x), moe.top_k, dim=-1)
    weights = torch.softmax(top, dim=-1)
    got = moe.static_routing(x, idx, weights)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    gathered = (moe.experts.routed(x, idx) * weights[..., None]).sum(1)
    torch.testing.assert_close(gathered, want, rtol=1e-5, atol=1e-5)


def test_dense_attention_reaches_a_model_built_from_a_source():
    from sparsegen.parallel.source import ModelSource

    engine = LLMEngine(ModelSource(random="tiny", seed=1), device="cpu", dense_attention=True)
    assert all(layer.is_dense for layer in engine.model.spec.layers)
    own = LLMEngine(ModelSource(random="tiny", seed=1), device="cpu")
    assert not all(layer.is_dense for layer in own.model.spec.layers)
