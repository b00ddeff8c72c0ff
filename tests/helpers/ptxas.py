"""ptxas's resource report (registers, stack, spills) for a CUDA source, through NVRTC."""

from __future__ import annotations

from sparsegen.jit import nvrtc_build as nb


def ptxas_report(source: str, arch: str) -> str:
    """Compile `source` for `arch` with `ptxas -v` and return what ptxas logged."""
    import cuda.core as core

    opts = core.ProgramOptions(
        name="regs.cu", arch=arch, std="c++17", include_path=[nb.cuda_include_dir()], ptxas_options=["-v"]
    )

    class _Log:
        text = ""

        def write(self, t: str) -> None:
            self.text += t

    log = _Log()
    core.Program(source, "c++", opts).compile("cubin", logs=log)
    return log.text
