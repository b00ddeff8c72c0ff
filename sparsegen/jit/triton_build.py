"""The Triton toolchain: import a rendered module, compile one of its @triton.jit kernels ahead
of time, and load the stored result back. Knows nothing about sparsity patterns or templates
(those live in `sparsegen.kernels.*_template`).

`aot_compile` compiles for an arch without a GPU through
`triton.compile(ASTSource(...), target=GPUTarget(...))`; the cubin and Triton's metadata JSON are
what a cache entry stores, and `load_compiled` turns them back into a launchable
`CompiledKernel` with no recompilation. Under TRITON_INTERPRET=1 an entry holds only the module
source, and `load_interpreted` imports its @triton.jit kernel.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

from ..env import parse_arch
from ..errors import CompileError
from .compile_errors import stderr_captured, triton_cause, triton_context


def import_module(path: Path, name: str) -> ModuleType:
    """Import a rendered kernel module from a file (Triton reads the jit functions' source)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CompileError(f"cannot import the rendered kernel {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(name, None)
        raise CompileError(f"the rendered kernel {path} does not import: {exc}") from exc
    return module


def aot_compile(
    source: str,
    *,
    fn_name: str,
    signature: dict[str, str],
    aligned: tuple[str, ...],
    arch: str,
    options: dict[str, int],
    module_name: str,
    source_file: str,
    gluon: bool = False,
) -> dict[str, bytes]:
    """Compile `fn_name` of the rendered module for `arch` (no GPU needed); Triton's files by name.

    `signature` maps argument names (in order) to Triton types; the `aligned` ones are compiled
    as divisible by 16, which the launcher must guarantee. `gluon`: the kernel is `@gluon.jit`.
    Inside `build_workers.using(...)` the build runs in a worker process (the same function)."""
    from . import build_workers

    job = {"source": source, "fn_name": fn_name, "signature": dict(signature), "aligned": list(aligned),
           "arch": arch, "options": dict(options), "module_name": module_name, "source_file": source_file,
           "gluon": gluon}  # fmt: skip
    workers = build_workers.current()
    return workers.compile(job) if workers is not None else compile_in_process(job)


def compile_in_process(job: dict) -> dict[str, bytes]:
    """`aot_compile` in this process (also what a build worker runs); `job` holds its arguments."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn_name, signature, arch, module_name = job["fn_name"], job["signature"], job["arch"], job["module_name"]
    names = list(signature)
    with tempfile.TemporaryDirectory(prefix="sparsegen-build-") as tmp:
        path = Path(tmp) / job["source_file"]
        path.write_text(job["source"])
        module = import_module(path, module_name)
        try:
            fn = getattr(module, fn_name)
            attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in job["aligned"]}
            if job["gluon"]:
                from ..kernels.gluon_api import GluonASTSource

                src = GluonASTSource(fn, signature, {}, attrs)
            else:
                src = ASTSource(fn, signature, constexprs={}, attrs=attrs)
            target = GPUTarget("cuda", parse_arch(arch), 32)
            # FP fusion on, as every tested Triton defaults (3.9 warns when it is left unset)
            options = {"enable_fp_fusion": True, **job["options"]}
            failure = None
            with stderr_captured() as err:  # a failed MLIR pass prints its error there
                try:
                    compiled = triton.compile(src, target=target, options=options)
                except Exception as exc:  # noqa: BLE001 - reported below, with what stderr got
                    failure = exc
            if failure is not None:
                kind = "Gluon kernel" if job["gluon"] else "kernel"
                raise CompileError(
                    f"Triton failed to compile the {kind} {fn_name} for {arch}: "
                    f"{triton_cause(failure, err.text)}\n\n{triton_context(failure)}"
                ) from failure
        finally:
            sys.modules.pop(module_name, None)
    files = {Path(p).name: Path(p).read_bytes() for p in compiled.metadata_group.values()}
    if not any(n.endswith(".cubin") for n in files) or not any(n.endswith(".json") for n in files):
        raise CompileError(f"Triton's build for {arch} lacks a cubin or metadata: {sorted(files)}")
    return files


def load_compiled(files: dict[str, Path], signature: dict[str, str], source_file: str):
    """A launchable CompiledKernel from the stored cubin + metadata (no recompilation)."""
    from triton.compiler.compiler import CompiledKernel

    group = {name: str(path) for name, path in files.items() if name != source_file}
    meta_path = next(Path(p) for n, p in group.items() if n.endswith(".json"))
    kernel_hash = json.loads(meta_path.read_text()).get("hash", "")
    # The launcher only needs the signature and constants; the source module is not imported.
    src = SimpleNamespace(signature=signature, constants={}, fn=None)
    return CompiledKernel(src, group, kernel_hash)


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar into an index with int() of a 1-element array,
    which NumPy >= 2.4 refuses; loops with run-time bounds (ours) then fail. Take the element."""
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_sparsegen_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._sparsegen_index_fix = True
    interpreter._patch_lang_tensor = patched


def load_interpreted(files: dict[str, Path], module_name: str, *, fn_name: str, source_file: str):
    """The @triton.jit kernel `fn_name` of the stored module, for Triton's interpreter."""
    _patch_interpreter_index()
    return getattr(import_module(files[source_file], module_name), fn_name)
