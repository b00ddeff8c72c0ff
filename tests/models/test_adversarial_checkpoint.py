"""Adversarial checkpoints: hostile config.json values, index paths that leave the folder, links,
malformed safetensors, missing / misshapen / mistyped tensors, leaked file handles.

Every case ends in a `CheckpointError` that names config.json and the field (or the file and the
tensor), or in a model whose weights equal the checkpoint's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import struct

import pytest
import torch
from helpers.adversarial import accepted, either, refused
from helpers.checkpoint import TINY_HF_CONFIG, random_tensors, write_bpe_file, write_checkpoint
from helpers.hf_configs import GEMMA2_9B, GPT_OSS_20B, MISTRAL_7B_V01, QWEN3_8B
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from sparsegen import CheckpointError, MissingExtraError, TokenizerError
from sparsegen.models import Phi3SmallConfig, load_checkpoint
from sparsegen.tokenizer import load_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")  # one torch thread here, restored after


@pytest.fixture(autouse=True)
def _private_tiktoken_cache(tmp_path, monkeypatch):
    """tiktoken copies every file it reads into its cache; keep those copies in tmp_path."""
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))


def _load(folder):
    return load_checkpoint(folder, dtype=torch.float32)


def _same_weights(tensors):
    def check(model):
        state = model.state_dict()
        return all(torch.equal(state[n], t) for n, t in tensors.items() if not n.endswith("inv_freq"))

    return check


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """One valid tiny checkpoint (config dict, tensors, folder)."""
    tensors = random_tensors(TINY_HF_CONFIG, seed=1)
    folder = write_checkpoint(tmp_path_factory.mktemp("good") / "ckpt", tensors=tensors)
    return TINY_HF_CONFIG, tensors, folder


def _with_config(tmp_path, good, cfg: dict | str):
    """The good checkpoint's weights (hard-linked, no copy) under another config.json."""
    _, _, src = good
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.link(src / "model.safetensors", folder / "model.safetensors")
    (folder / "config.json").write_text(cfg if isinstance(cfg, str) else json.dumps(cfg))
    return folder


# ---------------------------------------------------------------------------------------------
# config.json: every field, exact types and ranges, checked at load and named.

BAD_FIELDS = {
    "vocab_size": [-1, 0, True, 272.0, "272", None, 2**40],
    "hidden_size": [-256, 0, 256.5, "256", False, None, 2**40],
    "num_hidden_layers": [-1, 0, 4.0, True, 10**6],
    "num_attention_heads": [0, -4, 4.0, True, "4"],
    "num_key_value_heads": [0, -2, 3, 2.0, True],
    "ff_intermediate_size": [-512, 0, 512.5, "512", True, 2**40],
    "layer_norm_epsilon": [0, -1e-5, "1e-5", True, float("nan"), float("inf")],
    "gegelu_limit": [0, -20.0, float("nan"), "20", None],
    "max_position_embeddings": [0, -1, 4096.0, True, 2**40],
    "rope_embedding_base": [0, -10000.0, float("nan"), float("-inf"), "1e4", True, 10**400],
    "rope_position_scale": [0, -1.0, float("inf"), None],
    "mup_attn_multiplier": [0, -1.0, float("nan"), "1"],
    "mup_embedding_multiplier": [0, -10.0, float("inf"), [10.0]],
    "mup_width_multiplier": [0, 0.0, -8.0, float("nan"), float("inf"), "8", True],
    "mup_use_scaling": ["true", 1, 0, None, "false"],
    "tie_word_embeddings": ["false", 0, 1, None],
    "bos_token_id": [-1, 272, 2**40, 256.0, True, "256", None],
    "eos_token_id": [-1, 272, [], [256, 999], [True], "256", 256.5],
    "dummy_token_indices": ["all", [True], [-1], [272], [1.5], {"0": 1}],
    "blocksparse_block_size": [48, 0, -16, 16.0, True, "16", 2**40],
    "blocksparse_num_local_blocks": [-1, 2.0, True, "2"],
    "blocksparse_vert_stride": [-4, 4.5, True, 2**40],
    "blocksparse_homo_head_pattern": ["false", "true", 0, 1, None],
    "dense_attention_every_n_layers": [-1, 2.0, True, "2"],
    "model_type": ["mistral", "llama", 5, None, ""],
    "hidden_act": ["silu", "gelu", 3],
    "rope_scaling": ["longrope", 5, [], {"type": "dynamic", "factor": 2.0}, {"type": "yarn"}],
}


def _field_cases():
    for field, values in BAD_FIELDS.items():
        for value in values:
            yield pytest.param(field, value, id=f"{field}={value!r:.20}")


@pytest.mark.parametrize("field, value", list(_field_cases()))
def test_bad_config_fields_are_named(tmp_path, field, value):
    cfg = {**TINY_HF_CONFIG, field: value}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))  # NaN / Infinity are written as JSON's extensions
    exc = refused(CheckpointError, field, Phi3SmallConfig.from_file, path)
    assert str(path) in str(exc)


def _longrope(**changes):
    half = (TINY_HF_CONFIG["hidden_size"] // TINY_HF_CONFIG["num_attention_heads"]) // 2
    rs = {"type": "longrope", "short_factor": [1.0] * half, "long_factor": [1.0] * half,
          "original_max_position_embeddings": 1024, "short_mscale": 1.0, "long_mscale": 1.1}  # fmt: skip
    rs.update(changes)
    return rs


@pytest.mark.parametrize(
    "rope, match",
    [
        (_longrope(short_factor=[1.0] * 5), "short_factor"),
        (_longrope(short_factor=[True] * 32), r"short_factor\[0\]"),
        (_longrope(long_factor=[float("nan")] * 32), r"long_factor\[0\]"),
        (_longrope(long_factor=[1.0] * 31 + [0.0]), r"long_factor\[31\]"),
        (_longrope(long_factor=[1.0] * 31 + ["1"]), r"long_factor\[31\]"),
        (_longrope(short_mscale=float("inf")), "short_mscale"),
        (_longrope(long_mscale=-1.0), "long_mscale"),
        (_longrope(long_mscale="1.1"), "long_mscale"),
        (_longrope(original_max_position_embeddings=0), "original_max_position_embeddings"),
        (_longrope(original_max_position_embeddings=8192), "original_max_position_embeddings"),
        (_longrope(original_max_position_embeddings=1024.0), "original_max_position_embeddings"),
    ],
)
def test_bad_long_rope_fields_are_named(tmp_path, rope, match):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TINY_HF_CONFIG, "rope_scaling": rope}))
    refused(CheckpointError, match, Phi3SmallConfig.from_file, path)
    accepted(
        lambda c: c.rope_scaling is not None,
        Phi3SmallConfig.from_hf_dict,
        {**TINY_HF_CONFIG, "rope_scaling": _longrope()},
    )


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"hidden_size": 288, "num_attention_heads": 4}, "head_dim must be a multiple of 16 .* got 72"),
        ({"hidden_size": 1088, "num_attention_heads": 4}, "head_dim must be a multiple of 16 .* got 272"),
        ({"blocksparse_block_size": 48}, "block_size"),
        ({"blocksparse_vert_stride": 2**20}, "vert_stride"),
        ({"blocksparse_num_local_blocks": 0, "blocksparse_vert_stride": 0}, "cannot see its own position"),
    ],
)
def test_spec_errors_from_a_config_name_the_file(tmp_path, good, changes, match):
    """Caught at load, before any weight is read, and the message names config.json."""
    folder = _with_config(tmp_path, good, {**TINY_HF_CONFIG, **changes})
    exc = refused(CheckpointError, match, _load, folder)
    assert str(folder / "config.json") in str(exc)


@pytest.mark.parametrize(
    "cfg", [{**GPT_OSS_20B, "model_type": "falcon"}, {**GEMMA2_9B, "model_type": "phi3"}]
)
def test_other_models_are_refused_at_once_by_model_type(tmp_path, cfg):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))  # no weights: model_type decides first
    exc = refused(CheckpointError, f"model_type is '{cfg['model_type']}'", _load, folder)
    assert "config.json" in str(exc)


@pytest.mark.parametrize("cfg", [MISTRAL_7B_V01, QWEN3_8B, GPT_OSS_20B, GEMMA2_9B])
def test_served_families_read_config_then_want_weights(tmp_path, cfg):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))  # a family sparsegen runs: the weights are missing
    refused(CheckpointError, "no \\*.safetensors files", _load, folder)


def test_generate_would_have_printed_zeros(tmp_path, good):
    """mup_width_multiplier 0 and rope base 0 used to load and yield non-finite logits."""
    for field in ("mup_width_multiplier", "rope_embedding_base"):
        folder = tmp_path / field
        folder.mkdir()
        os.link(good[2] / "model.safetensors", folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, field: 0}))
        refused(CheckpointError, f"{field}.*> 0", _load, folder)


def test_deep_and_hostile_config_json(tmp_path, good):
    for text, match in [
        ("[" * 100_000 + "]" * 100_000, "nested 100000 levels"),
        (json.dumps(TINY_HF_CONFIG)[:-1] + ', "rope_scaling": ' + '{"a":' * 5000 + "1" + "}" * 5000 + "}", "nested"),
        ('{"vocab_size": 272, "vocab_size": 273}', "appears twice"),
        ('{"vocab_size": ' + "9" * 5000 + "}", "not usable JSON"),
        ("[]", "must hold a JSON object"),
        ("", "not valid JSON"),
    ]:  # fmt: skip
        folder = tmp_path / f"c{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "config.json").write_text(text)
        exc = refused(CheckpointError, match, _load, folder)
        assert "config.json" in str(exc)


# random JSON-ish values for any config field: the loader either refuses with the field named,
# or the value it keeps is the one given
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(sorted(TINY_HF_CONFIG)), value=json_values)
def test_fuzzed_config_fields(field, value):
    cfg = {**TINY_HF_CONFIG, field: value}
    config = either(CheckpointError, lambda c: isinstance(c, Phi3SmallConfig), Phi3SmallConfig.from_hf_dict,
                    json.loads(json.dumps(cfg)), source="fuzz/config.json")  # fmt: skip
    if isinstance(config, CheckpointError):
        assert "fuzz/config.json" in str(config)
        return
    kept = getattr(config, field, None)
    if (
        field in Phi3SmallConfig.__dataclass_fields__
        and value is not None
        and field not in ("eos_token_id", "dummy_token_indices", "rope_scaling")
    ):
        # a float field holds the nearest float to an int it was given (2**53 + 1 -> 2**53)
        assert (
            kept == value and type(kept) is type(value) or (isinstance(kept, float) and kept == float(value))
        )
    for name in (
        "rope_embedding_base",
        "mup_width_multiplier",
        "layer_norm_epsilon",
        "mup_embedding_multiplier",
    ):
        assert math.isfinite(getattr(config, name)) and getattr(config, name) > 0


# ---------------------------------------------------------------------------------------------
# Paths: nothing is read from outside the checkpoint folder.


def _indexed(tmp_path, good, entry: str, name: str = "model.final_layernorm.bias"):
    _, tensors, src = good
    folder = write_checkpoint(tmp_path / "ckpt", tensors=tensors, shards=2)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][name] = entry
    index_path.write_text(json.dumps(index))
    return folder


def _outside_shard(tmp_path, good):
    """A valid safetensors file outside the folder that holds the tensor the index redirects."""
    other = tmp_path / "other"
    other.mkdir()
    save_file({"model.final_layernorm.bias": torch.full((256,), 7.0)}, str(other / "x.safetensors"))
    return other / "x.safetensors"


@pytest.mark.parametrize(
    "entry, match",
    [
        ("../other/x.safetensors", "not a file name inside"),
        ("sub/../../other/x.safetensors", "not a file name inside"),
        ("ABS", "not a file name inside"),
        ("", "not a .safetensors file|not a file name"),
        ("config.json", "not a .safetensors file"),
        ("model-00001-of-00002.safetensors\0x", "not a file name inside|does not exist"),
        ("missing.safetensors", "does not exist"),
    ],
)
def test_index_entries_that_leave_the_folder_are_refused(tmp_path, good, entry, match):
    outside = _outside_shard(tmp_path, good)
    entry = str(outside) if entry == "ABS" else entry
    refused(CheckpointError, match, _load, _indexed(tmp_path, good, entry))


def test_symlinks_leaving_the_folder_are_refused(tmp_path, good):
    _, tensors, _ = good
    outside = _outside_shard(tmp_path, good)
    # a shard that is a link to a file outside
    folder = _indexed(tmp_path, good, "link.safetensors")
    (folder / "link.safetensors").symlink_to(outside)
    refused(CheckpointError, "leads outside", _load, folder)
    # the whole model.safetensors a link outside (no index)
    single = write_checkpoint(tmp_path / "single", tensors=tensors)
    real = tmp_path / "elsewhere.safetensors"
    (single / "model.safetensors").rename(real)
    (single / "model.safetensors").symlink_to(real)
    refused(CheckpointError, "leads outside", _load, single)
    # config.json and the index as links outside
    cfg_link = write_checkpoint(tmp_path / "cfglink", tensors=tensors)
    (cfg_link / "config.json").rename(tmp_path / "cfg.json")
    (cfg_link / "config.json").symlink_to(tmp_path / "cfg.json")
    refused(CheckpointError, "config.json.*leads outside", _load, cfg_link)
    idx = write_checkpoint(tmp_path / "idx", tensors=tensors, shards=2)
    (idx / "model.safetensors.index.json").rename(tmp_path / "index.json")
    (idx / "model.safetensors.index.json").symlink_to(tmp_path / "index.json")
    refused(CheckpointError, "index.json.*leads outside", _load, idx)
    # a link loop and a dangling link
    loop = write_checkpoint(tmp_path / "loop", tensors=tensors)
    (loop / "a.safetensors").symlink_to(loop / "b.safetensors")
    (loop / "b.safetensors").symlink_to(loop / "a.safetensors")
    refused(CheckpointError, "a.safetensors", _load, loop)
    dangling = write_checkpoint(tmp_path / "dangling", tensors=tensors)
    (dangling / "zz.safetensors").symlink_to(tmp_path / "nowhere")
    refused(CheckpointError, "zz.safetensors.*does not exist", _load, dangling)


def test_links_inside_the_folder_and_hub_snapshots_load(tmp_path, good):
    _, tensors, src = good
    inside = write_checkpoint(tmp_path / "inside", tensors=tensors)
    (inside / "model.safetensors").rename(inside / "weights.bin")
    (inside / "model.safetensors").symlink_to("weights.bin")
    accepted(_same_weights(tensors), _load, inside)
    # huggingface_hub's cache: snapshots/<rev>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--microsoft--Phi-3-small"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for n, blob in (("config.json", "c0ffee"), ("model.safetensors", "beef")):
        os.link(src / n, repo / "blobs" / blob)
        (snap / n).symlink_to(f"../../blobs/{blob}")
    accepted(_same_weights(tensors), _load, snap)


def test_special_files_are_not_read(tmp_path, good):
    _, tensors, _ = good
    folder = write_checkpoint(tmp_path / "fifo", tensors=tensors)
    os.mkfifo(folder / "zz.safetensors")  # reading it would block forever
    refused(CheckpointError, "not a regular file", _load, folder)
    d = write_checkpoint(tmp_path / "dir", tensors=tensors)
    (d / "zz.safetensors").mkdir()
    refused(CheckpointError, "not a regular file", _load, d)


# ---------------------------------------------------------------------------------------------
# Tensors: malformed files, missing, misshapen and mistyped tensors are named.


def _header_file(path, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: p.write_bytes(b""), "cannot read"),
        (lambda p: p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage"), "cannot read"),
        (lambda p: p.write_bytes(struct.pack("<Q", 2**62) + b"{}"), "cannot read"),
        (lambda p: p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2]), "cannot read"),
        (lambda p: _header_file(p, {"model.embed_tokens.weight": {"dtype": "F99", "shape": [2], "data_offsets": [0, 8]}},
                                b"\0" * 8), "cannot read"),
        (lambda p: _header_file(p, {"model.embed_tokens.weight": {"dtype": "F32", "shape": [4], "data_offsets": [0, 999]}},
                                b"\0" * 16), "cannot read"),
        (lambda p: _header_file(p, {"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
         "cannot read"),
        (lambda p: _header_file(p, {"__metadata__": {"format": 5}}), "cannot read|lacks tensor"),
    ],
)  # fmt: skip
def test_malformed_safetensors_files(tmp_path, good, make, match):
    _, tensors, _ = good
    folder = write_checkpoint(tmp_path / "bad", tensors=tensors)
    make(folder / "model.safetensors")
    exc = refused(CheckpointError, match, _load, folder)
    assert "model.safetensors" in str(exc)


MISSING = ["model.embed_tokens.weight", "model.layers.0.self_attn.query_key_value.weight",
           "model.layers.3.mlp.down_proj.bias", "model.final_layernorm.weight"]  # fmt: skip


@pytest.mark.parametrize("name", MISSING)
def test_missing_tensor_is_named(tmp_path, good, name):
    _, tensors, _ = good
    folder = write_checkpoint(tmp_path / "m", tensors={k: v for k, v in tensors.items() if k != name})
    refused(CheckpointError, f"lacks tensor '{name}'", _load, folder)


BAD_TENSORS = [
    ("model.layers.0.self_attn.dense.weight", lambda t: t.t()[:, :-1].contiguous(), "shape"),
    ("model.layers.0.self_attn.dense.bias", lambda t: t[None], "shape"),
    ("model.layers.1.mlp.up_proj.weight", lambda t: t.reshape(-1), "shape"),
    ("model.final_layernorm.bias", lambda t: t[0].clone(), "shape"),
    ("model.embed_tokens.weight", lambda t: t.to(torch.int32), "dtype torch.int32"),
    ("model.embed_tokens.weight", lambda t: t.to(torch.int64), "dtype torch.int64"),
    ("model.final_layernorm.weight", lambda t: t > 1, "dtype torch.bool"),
    ("model.final_layernorm.weight", lambda t: t.to(torch.uint8), "dtype torch.uint8"),
    ("model.final_layernorm.weight", lambda t: t.to(torch.float8_e4m3fn), "dtype torch.float8_e4m3fn"),
    ("model.final_layernorm.bias", lambda t: t.index_fill(0, torch.tensor([3]), float("nan")), "not finite"),
    ("model.layers.2.mlp.down_proj.weight", lambda t: t.index_fill(1, torch.tensor([0]), float("inf")), "not finite"),
]  # fmt: skip


@pytest.mark.parametrize("name, change, match", BAD_TENSORS)
def test_bad_tensors_are_named(tmp_path, good, name, change, match):
    _, tensors, _ = good
    changed = {**tensors, name: change(tensors[name])}
    folder = tmp_path / "t"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_HF_CONFIG))
    save_file(changed, str(folder / "model.safetensors"))
    exc = refused(CheckpointError, match, _load, folder)
    assert repr(name) in str(exc)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_load(tmp_path, good, dtype):
    _, tensors, _ = good
    folder = write_checkpoint(tmp_path / "d", tensors=tensors, dtype=dtype)
    want = {k: v.to(dtype).float() for k, v in tensors.items()}
    accepted(_same_weights(want), _load, folder)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_fuzzed_safetensors_bytes(tmp_path_factory, good, data):
    """Flip, cut or splice bytes of a valid file: a CheckpointError, or a model that holds exactly
    the (finite) values now in the file."""
    _, tensors, src = good
    blob = bytearray((src / "model.safetensors").read_bytes())
    header_len = struct.unpack("<Q", bytes(blob[:8]))[0]
    kind = data.draw(st.sampled_from(["flip-header", "flip-data", "cut", "len"]))
    if kind == "flip-header":
        for _ in range(data.draw(st.integers(1, 4))):
            blob[data.draw(st.integers(8, 8 + header_len - 1))] = data.draw(st.integers(0, 255))
    elif kind == "flip-data":
        blob[data.draw(st.integers(8 + header_len, len(blob) - 1))] ^= 0xFF
    elif kind == "cut":
        blob = blob[: data.draw(st.integers(0, len(blob) - 1))]
    else:
        blob[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    folder = tmp_path_factory.mktemp("fz")
    (folder / "config.json").write_bytes((src / "config.json").read_bytes())
    (folder / "model.safetensors").write_bytes(bytes(blob))
    from safetensors.torch import load_file

    def holds_the_file_values(model) -> bool:
        state = model.state_dict()
        now = load_file(str(folder / "model.safetensors"))
        return all(
            torch.equal(state[n], t.float()) and bool(torch.isfinite(t).all())
            for n, t in now.items()
            if not n.endswith("inv_freq")
        )

    either(CheckpointError, holds_the_file_values, _load, folder)


# ---------------------------------------------------------------------------------------------
# Leaks: a refused checkpoint leaves no file open.


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to count open files")
def test_refused_checkpoints_leave_no_file_open(tmp_path, good):
    _, tensors, _ = good
    bad = {**tensors, "model.final_layernorm.bias": tensors["model.final_layernorm.bias"][:3].clone()}
    folders = [
        write_checkpoint(tmp_path / "shape", tensors=bad),
        write_checkpoint(
            tmp_path / "missing", tensors={k: v for k, v in tensors.items() if "embed" not in k}
        ),
        _indexed(tmp_path / "x", good, "../escape.safetensors") if (tmp_path / "x").mkdir() is None else None,
    ]
    before = _open_fds()
    for _ in range(5):
        for folder in folders:
            refused(CheckpointError, ".", _load, folder)
    assert _open_fds() == before


# ---------------------------------------------------------------------------------------------
# Tokenizer files: read by tiktoken with a hash check; hostile files are TokenizerErrors.


def _bpe(path, lines=None):
    if lines is None:
        return write_bpe_file(path)
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


@pytest.mark.parametrize(
    "lines, match",
    [
        ([], "holds no tokens"),
        (["YQ== 0", "not-base64!! 1"], "not a .tiktoken file"),
        (["YQ== 0", "Yg== x"], "not a .tiktoken file"),
        (["YQ== 0", "Yg== 1 2"], "not a .tiktoken file"),
        (["YQ== 0", "YQ== 1"], "each token must appear once"),
        (["YQ== 0", "Yg== 2"], "ranked 0..n-1"),
        (["YQ== 0", "Yg== 0"], "ranked 0..n-1"),
        (["YQ== 0", f"Yg== {10**12}"], "ranked 0..n-1"),
        (["YQ== -1"], "ranked 0..n-1"),
    ],
)
def test_malformed_tiktoken_files(tmp_path, lines, match):
    refused(TokenizerError, match, load_tokenizer, _bpe(tmp_path / "v.tiktoken", lines))


def test_tiktoken_hash_check(tmp_path):
    fake = _bpe(tmp_path / "cl100k_base.tiktoken")  # the published name, other bytes
    refused(TokenizerError, "SHA-256 .* expected 223921b7", load_tokenizer, fake)
    own = _bpe(tmp_path / "own.tiktoken")
    digest = hashlib.sha256(own.read_bytes()).hexdigest()
    accepted(lambda t: t.encode("hello world") == [259, 263], load_tokenizer, own, expected_hash=digest)
    refused(TokenizerError, "SHA-256", load_tokenizer, own, expected_hash="0" * 64)


def test_tiktoken_cache_never_serves_stale_or_planted_ranks(tmp_path, monkeypatch):
    """tiktoken keys its file cache by path; without a hash it returns a stale or planted copy."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    path = _bpe(tmp_path / "v.tiktoken")
    accepted(lambda t: t.encode("hello") == [259], load_tokenizer, path)
    assert any(cache.iterdir())  # tiktoken did cache it
    # the file changes: the new ranks are read, not the cached ones
    _bpe(path, [f"{base64.b64encode(bytes([i])).decode()} {i}" for i in range(256)])
    accepted(lambda t: t.encode("hello") == list(b"hello"), load_tokenizer, path)
    # someone plants other ranks under the key of this path
    other = tmp_path / "other.tiktoken"
    _bpe(other)
    for entry in cache.iterdir():
        entry.write_bytes(other.read_bytes())
    accepted(lambda t: t.encode("hello") == list(b"hello"), load_tokenizer, path)


def test_tokenizer_files_stay_inside_the_folder(tmp_path):
    outside = _bpe(tmp_path / "outside.tiktoken")
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "a.tiktoken").symlink_to(outside)
    refused(TokenizerError, "leads outside", load_tokenizer, folder)
    fifo = tmp_path / "f"
    fifo.mkdir()
    os.mkfifo(fifo / "a.tiktoken")
    refused(TokenizerError, "not a regular file", load_tokenizer, fifo)
    d = tmp_path / "d"
    (d / "a.tiktoken").mkdir(parents=True)
    refused(TokenizerError, "not a regular file", load_tokenizer, d)


@pytest.mark.parametrize(
    "text, match",
    [
        ("[" * 100_000 + "]" * 100_000, "nested 100000 levels"),
        ('{"added_tokens_decoder": []}', "added_tokens_decoder must be an object"),
        ('{"added_tokens_decoder": {"x": {"content": "<|a|>"}}}', "added_tokens_decoder"),
        ('{"added_tokens_decoder": {"-1": {"content": "<|a|>"}}}', "added_tokens_decoder"),
        ('{"added_tokens_decoder": {"99999999999": {"content": "<|a|>"}}}', "added_tokens_decoder"),
        ('{"added_tokens_decoder": {"300": {"content": 5}}}', "added_tokens_decoder"),
        ('{"added_tokens_decoder": {"300": "x"}}', "added_tokens_decoder"),
        ('{"added_tokens_decoder": {"300": {"content": "<|a|>"}}}', "lack <|endoftext|>"),
        ('{"added_tokens_decoder": {"3": {"content": "<|endoftext|>"}}}', "reuses id 3"),
        ('{"a": 1, "a": 2}', "appears twice"),
    ],
)
def test_hostile_tokenizer_config(tmp_path, text, match):
    _bpe(tmp_path / "v.tiktoken")
    (tmp_path / "tokenizer_config.json").write_text(text)
    refused(TokenizerError, match, load_tokenizer, tmp_path)


def test_tokenizer_vocab_size_is_exact(tmp_path):
    path = _bpe(tmp_path / "v.tiktoken")
    for bad in (True, 300.0, "300", 0, -1, 2**40):
        refused(TokenizerError, "vocab_size", load_tokenizer, path, vocab_size=bad)


def test_missing_tiktoken_names_the_extra(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    monkeypatch.setitem(sys.modules, "tiktoken.load", None)
    refused(MissingExtraError, r"sparsegen\[model\]", load_tokenizer, _bpe(tmp_path / "v.tiktoken"))


def test_token_ids_and_text_take_exact_types(tmp_path):
    from sparsegen.models.config import TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE
    from sparsegen.tokenizer import ByteTokenizer

    for tok in (
        load_tokenizer(_bpe(tmp_path / "v.tiktoken")),
        ByteTokenizer(TINY_SPECIAL_TOKENS, TINY_VOCAB_SIZE),
    ):
        for bad in ([1, True, 2], [1.0], ["a"], [None], [-1], [10**9], [2**70]):
            refused(TokenizerError, "token id", tok.decode, bad)
        for bad in ("abc", 5, None, b"ab"):
            refused(TokenizerError, "decode takes a list", tok.decode, bad)
        for bad in (b"hello", 5, None, ["hello"]):
            refused(TokenizerError, "encode takes a str", tok.encode, bad)
        refused(TokenizerError, "token id", tok.stream_decoder(), True)
        accepted(lambda s: s == "hello", tok.decode, tok.encode("hello"))
