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


def ptx_report(ptx: str, arch: str = "sm_90a") -> str:
    """Assemble Triton-emitted PTX with Triton's own ptxas (`-v`, as Triton runs it) and return
    its resource report: the .maxnreg the kernel carries, registers, stack and spill bytes."""
    import subprocess
    import tempfile
    from pathlib import Path

    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        done = subprocess.run(
            [knobs.nvidia.ptxas.path, "-v", f"--gpu-name={arch}", str(src), "-o", str(out)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    return done.stdout + done.stderr
