"""The failure that sparsegen.runner.graph_capture.capture guards against, shown with plain
torch.cuda.graph: a reference cycle holding a captured CUDA graph becomes unreachable during
another capture, an automatic collection starts there and destroys the old graph, which CUDA
forbids while a stream captures. Prints what happened and exits 0 either way; on a GPU:

    python benchmarks/tools/gc_capture_hazard.py
"""

from __future__ import annotations

import gc

import torch


class Holder:
    def __init__(self, x: torch.Tensor):
        self.me, self.graph = self, torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = x * 3


def main() -> None:
    x = torch.randn(1 << 16, device="cuda")
    holder = Holder(x)
    graph, saved = torch.cuda.CUDAGraph(), gc.get_threshold()
    try:
        with torch.cuda.graph(graph):
            y = x * 2
            del holder
            gc.set_threshold(1)
            junk = [[i] for i in range(5000)]
            y += 1
        gc.set_threshold(*saved)
        graph.replay()
        torch.cuda.synchronize()
        print(
            f"plain torch.cuda.graph: capture survived ({len(junk)} allocations), replay equal:",
            torch.equal(y, x * 2 + 1),
        )
    except Exception as err:  # noqa: BLE001 - the point is to show which error it is
        gc.set_threshold(*saved)
        print(f"plain torch.cuda.graph: capture failed: {type(err).__name__}: {str(err)[:300]}")
    try:
        z = torch.ones(4, device="cuda") + 1
        torch.cuda.synchronize()
        print("the next eager op after it:", z.tolist())
    except Exception as err:  # noqa: BLE001
        print(f"the next eager op after it failed: {type(err).__name__}: {str(err)[:300]}")


if __name__ == "__main__":
    main()
