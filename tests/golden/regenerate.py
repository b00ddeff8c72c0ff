"""Rewrite the golden snapshots after a deliberate template change: python tests/golden/regenerate.py"""

from pathlib import Path

import sparsegen
from sparsegen.jit import triton_build

layer = sparsegen.get_pattern("phi3small").layers[0]
source = triton_build.render_source(layer, triton_build.pick_config("bf16", 128, "sm_90"))
(Path(__file__).parent / "prefill_phi3small_sm90.py.txt").write_text(source)
