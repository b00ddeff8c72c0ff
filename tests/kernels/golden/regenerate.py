"""Rewrite the golden snapshots after a deliberate template change: python tests/kernels/golden/regenerate.py"""

import json
import sys
from pathlib import Path

import sparsegen
from sparsegen.kernels import decode_template, prefill_gluon_template, prefill_template

layer = sparsegen.get_pattern("phi3small").layers[0]
source = prefill_template.render_source(layer, prefill_template.pick_config("bf16", 128, "sm_90"))
(Path(__file__).parent / "prefill_phi3small_sm90.py.txt").write_text(source)
source = decode_template.render_source(layer, "bf16", 16)
(Path(__file__).parent / "decode_phi3small_bf16_ps16.cu.txt").write_text(source)
source = prefill_gluon_template.render_source(layer, "bf16")
(Path(__file__).parent / "prefill_gluon_phi3small_bf16.py.txt").write_text(source)
sys.path.insert(0, str(Path(__file__).parents[2]))  # tests/, for helpers.gluon_render_cases
from helpers.gluon_render_cases import digests  # noqa: E402

text = json.dumps(digests(), indent=1, sort_keys=True) + "\n"
(Path(__file__).parent / "prefill_gluon_render_sha256.json").write_text(text)
