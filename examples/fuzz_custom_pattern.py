"""Define your own hybrid pattern and fuzz sparsegen's generated kernel against the reference.

    python examples/fuzz_custom_pattern.py                     # GPU, bf16
    TRITON_INTERPRET=1 python examples/fuzz_custom_pattern.py  # CPU interpreter, fp16

Half the heads use local blocks plus a vertical stride, a quarter a sliding window, the rest
are dense: one layer, three specialised code paths.
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparsegen import HeadSpec, LayerSpec, prefill
from sparsegen.testing import prefill_problems, rel_err

heads = (
    [HeadSpec(block_size=32, local_blocks=2, vert_stride=4, vert_offset=h % 4) for h in range(4)]
    + [HeadSpec(block_size=32, sliding_window=100)] * 2
    + [HeadSpec(dense=True)] * 2
)
layer = LayerSpec(num_heads=8, num_kv_heads=2, head_dim=64, heads=tuple(heads))

on_gpu = torch.cuda.is_available()
device, dtype, max_len, tol = (
    ("cuda", torch.bfloat16, 3000, 2e-2) if on_gpu else ("cpu", torch.float16, 200, 5e-3)
)


def main() -> None:
    @settings(max_examples=20, deadline=None, database=None)
    @given(prefill_problems(layers=st.just(layer), max_len=max_len, dtype=dtype, device=device))
    def check(problem):
        err = rel_err(prefill(*problem.args(), impl="triton"), problem.reference())
        assert err < tol, f"rel err {err:.3g}\nrepro: {problem.repro()}"

    check()
    print(
        f"20 random batches of the custom pattern match the reference ({'GPU' if on_gpu else 'interpreter'})"
    )


if __name__ == "__main__":
    main()
