"""Constrained decoding on a GPU (`pytest -m gpu`): decode steps replay CUDA graphs and the
grammar masks are applied to their logits outside the graphs; schemas validate, and the free
rows of a mixed batch are what they are without any constrained row beside them."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import extras

from sparsegen.request.sampling_params import SamplingParams
from sparsegen.request.structured_outputs import StructuredOutputsParams as S
from sparsegen.runner.sampling import sample
from sparsegen.runner.token_mask import apply_token_bitmask

pytestmark = pytest.mark.gpu

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
            "additionalProperties": False,  # else a sampled random model may write a key until max_tokens
        },
    },
    "required": ["id", "tags", "inner"],
    "additionalProperties": False,
}


def test_mask_on_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 100352, generator=gen)
    mask = torch.randint(-(2**31), 2**31 - 1, (6, 3136), generator=gen, dtype=torch.int32)
    params = [
        SamplingParams(structured_outputs=S(regex="a")) if r % 2 else SamplingParams() for r in range(6)
    ]
    cpu = apply_token_bitmask(x, mask, params)
    gpu = apply_token_bitmask(x.cuda(), mask, params).cpu()
    assert torch.equal(cpu, gpu)
    a = sample(x, params, [[]] * 6, token_bitmask=mask).token_ids
    b = sample(x.cuda(), params, [[]] * 6, token_bitmask=mask).token_ids
    assert a == b


def test_schemas_validate_over_cuda_graphs_and_free_rows_are_untouched():
    extras.require("llguidance")
    jsonschema = extras.require("jsonschema")
    from sparsegen import LLM

    llm = LLM(random="tiny", device="cuda", max_num_seqs=16, kv_cache_bytes=1 << 30)
    assert llm.engine.graphs is not None  # decode steps replay CUDA graphs
    constrained = [
        SamplingParams(max_tokens=1000, temperature=1.0, seed=s, structured_outputs=S(json=SCHEMA))
        for s in range(8)
    ]
    free = [
        SamplingParams(max_tokens=24, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.0, seed=9),
    ]
    outs = [r.outputs[0] for r in llm.generate(["json:"] * 10, constrained + free, use_tqdm=False)]
    for out in outs[:8]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    alone = [r.outputs[0] for r in llm.generate(["json:"] * 2, free, use_tqdm=False)]
    assert [o.token_ids for o in outs[8:]] == [o.token_ids for o in alone]
    choice = SamplingParams(max_tokens=10, structured_outputs=S(choice=["left", "right"]))
    assert llm.generate(["pick"], choice, use_tqdm=False)[0].outputs[0].text in ("left", "right")
