"""Specs: validation names the field and value, JSON round trips, stable digests, presets."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

import sparsegen as sg
from sparsegen import HeadSpec, LayerSpec, ModelSpec, SpecError, presets
from sparsegen.testing import head_specs, layer_specs


def test_phi3small_preset_structure():
    model = sg.get_pattern("phi3small")
    assert len(model.layers) == 32
    for i, layer in enumerate(model.layers):
        assert layer.is_dense == (i % 2 == 1), i
        assert (layer.num_heads, layer.num_kv_heads, layer.head_dim) == (32, 8, 128)
    sparse = model.layers[0]
    assert [h.vert_offset for h in sparse.heads] == [h % 8 for h in range(32)]
    assert all(h.block_size == 64 and h.local_blocks == 16 and h.vert_stride == 8 for h in sparse.heads)
    assert len(set(sparse.heads)) == 8
    assert [len(idx) for _, idx in model.distinct_layers()] == [16, 16]


def test_other_presets():
    sw = sg.get_pattern("sliding-window")
    assert all(h.sliding_window == 4096 for layer in sw.layers for h in layer.heads)
    assert sg.get_pattern("dense").layers[0].is_dense
    assert sg.get_pattern("phi3small-128k").layers[0] == sg.get_pattern("phi3small").layers[0]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 48, "local_blocks": 1}, "block_size"),
        ({"block_size": 8, "local_blocks": 1}, "block_size"),
        ({"block_size": 512, "local_blocks": 1}, "block_size"),
        ({"local_blocks": -1, "dense": True}, "local_blocks"),
        ({"local_blocks": 2, "vert_stride": 4, "vert_offset": 4}, "vert_offset"),
        ({"local_blocks": 2, "vert_offset": 1}, "vert_offset"),
        ({"vert_stride": 4}, "see its own position"),
        ({}, "see its own position"),
        ({"local_blocks": 1.0}, "local_blocks"),
        ({"local_blocks": True}, "local_blocks"),
        ({"dense": 1}, "dense"),
        ({"sliding_window": -5, "local_blocks": 1}, "sliding_window"),
    ],
)
def test_head_spec_errors_name_the_field(kwargs, field):
    with pytest.raises(SpecError, match=field):
        HeadSpec(**kwargs)


def test_layer_spec_errors():
    head = HeadSpec(local_blocks=1)
    with pytest.raises(SpecError, match="multiple of num_kv_heads"):
        LayerSpec(num_heads=6, num_kv_heads=4, head_dim=64, heads=(head,) * 6)
    with pytest.raises(SpecError, match="head_dim.*72"):
        LayerSpec(num_heads=2, num_kv_heads=1, head_dim=72, heads=(head,) * 2)
    with pytest.raises(SpecError, match="3 entries"):
        LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(head,) * 3)
    with pytest.raises(SpecError, match=r"heads\[1\]"):
        LayerSpec(num_heads=2, num_kv_heads=1, head_dim=64, heads=(head, "dense"))
    with pytest.raises(SpecError, match="ModelSpec.layers"):
        ModelSpec(name="x", layers=())
    assert isinstance(SpecError("x"), ValueError)


@given(layer_specs())
def test_layer_json_round_trip(layer):
    assert LayerSpec.from_json(layer.to_json()) == layer
    assert LayerSpec.from_json(layer.to_json()).digest() == layer.digest()


@given(head_specs())
def test_head_digest_is_stable_and_order_free(head):
    shuffled = dict(reversed(list(head.to_dict().items())))
    assert HeadSpec.from_dict(shuffled).digest() == head.digest()
    assert len(head.digest()) == 64


def test_model_json_round_trip_and_file(tmp_path):
    model = sg.get_pattern("phi3small")
    assert ModelSpec.from_json(model.to_json()) == model
    path = tmp_path / "spec.json"
    path.write_text(model.to_json())
    assert sg.get_pattern(str(path)) == model
    # The round trip keeps the digest; tests/test_digest_pins.py pins its literal value.
    assert model.layers[0].digest() == LayerSpec.from_json(model.layers[0].to_json()).digest()


def test_digest_differs_with_content():
    a = HeadSpec(local_blocks=2)
    assert a.digest() != HeadSpec(local_blocks=3).digest()


_FIELD_VALUES = st.one_of(
    st.integers(-3, 600), st.booleans(), st.none(), st.floats(-2, 2), st.text(max_size=3)
)


@given(
    st.dictionaries(
        st.sampled_from(
            ["block_size", "local_blocks", "vert_stride", "vert_offset", "sliding_window", "dense", "bogus"]
        ),
        _FIELD_VALUES,
    )
)
def test_fuzzed_head_dicts_only_raise_spec_error(data):
    try:
        HeadSpec.from_dict(data)
    except SpecError:
        pass


@given(
    st.recursive(
        st.one_of(st.integers(-2, 300), st.booleans(), st.none(), st.text(max_size=4)),
        lambda c: st.one_of(
            st.lists(c, max_size=3),
            st.dictionaries(
                st.sampled_from(
                    [
                        "format",
                        "name",
                        "layers",
                        "num_heads",
                        "num_kv_heads",
                        "head_dim",
                        "heads",
                        "local_blocks",
                        "dense",
                    ]
                ),
                c,
                max_size=4,
            ),
        ),
        max_leaves=12,
    )
)
def test_fuzzed_model_json_only_raises_spec_error(data):
    if isinstance(data, dict):
        data = {**data, "format": "sparsegen.spec/1"}
    try:
        ModelSpec.from_json(json.dumps(data))
    except SpecError:
        pass


def test_bad_json_and_unknown_fields():
    with pytest.raises(SpecError, match="not valid JSON"):
        ModelSpec.from_json("{")
    with pytest.raises(SpecError, match="bogus"):
        HeadSpec.from_dict({"bogus": 1})
    with pytest.raises(SpecError, match="missing"):
        LayerSpec.from_dict({"num_heads": 1})


def _hf_config(**extra):
    cfg = {
        "model_type": "phi3small",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "blocksparse_block_size": 64,
        "blocksparse_num_local_blocks": 16,
        "blocksparse_vert_stride": 8,
        "blocksparse_homo_head_pattern": False,
        "dense_attention_every_n_layers": 2,
    }
    cfg.update(extra)
    return cfg


def test_hf_config_maps_to_phi3small(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_hf_config()))
    assert sg.get_pattern(str(path)).layers == sg.get_pattern("phi3small").layers


def test_hf_config_homo_head_and_window(tmp_path):
    homo = presets.from_hf_config(_hf_config(blocksparse_homo_head_pattern=True))
    assert len(set(homo.layers[0].heads)) == 1
    mistral = {
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_hidden_layers": 2,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
    }
    assert presets.from_hf_config(mistral).layers[0].heads[0].sliding_window == 4096


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"sliding_window": 2048}, "both blocksparse"),
        ({"blocksparse_block_size": 48}, "block_size"),
        ({"hidden_size": 4100}, "multiple"),
        ({"num_attention_heads": "32"}, "num_attention_heads"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
        ({"hidden_size": 2304}, "head_dim"),
    ],
)
def test_hf_config_errors(extra, match):
    with pytest.raises(SpecError, match=match):
        presets.from_hf_config(_hf_config(**extra))


def test_get_pattern_errors(tmp_path):
    with pytest.raises(SpecError, match="neither a preset"):
        sg.get_pattern("no-such-pattern")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SpecError, match="neither a sparsegen spec"):
        sg.get_pattern(str(bad))
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\xff\xfe{")
    with pytest.raises(SpecError, match="cannot read"):
        sg.get_pattern(str(garbage))


def test_tensor_parallel_shard_uses_global_head_index():
    shard = presets.blocksparse_heads(
        8, block_size=64, local_blocks=16, vert_stride=8, first_head=8, total_heads=32
    )
    full = sg.get_pattern("phi3small").layers[0].heads
    assert shard == full[8:16]
