"""One Triton build, in this process: import a rendered module and compile one of its kernels
ahead of time for an arch (no GPU needed). `triton_build.aot_compile` calls it here or hands the
same job to a build worker process (`build_workers`), which runs this same function there.

A job is a JSON-able dict:

    source, source_file, module_name   the rendered module, the file name it is imported from
    fn_name                            its @triton.jit (or @gluon.jit) kernel
    signature                          {argument name: Triton type}, every argument in order;
                                       "constexpr" for compile-time ones
    constexprs                         [[argument index, value], ...]   (optional)
    aligned                            [argument name, ...] compiled as divisible by 16
    attrs                              [[argument index, Triton attribute list], ...] (optional)
    arch, options                      the target, Triton's compile options
    ast_source                         "module:attribute" of the AST source class that wraps the
                                       kernel (Gluon's, from the caller's side); None: Triton's
                                       ASTSource. A name, not a class, so the job stays JSON-able
                                       and this layer imports nothing above it.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from ..env import parse_arch
from ..errors import CompileError
from .compile_errors import stderr_captured, triton_cause, triton_context

DIVISIBLE_16 = [["tt.divisibility", 16]]


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


def job_attrs(job: dict) -> dict[tuple[int, ...], list]:
    """The job's per-argument attributes: the `aligned` names as divisible by 16, then `attrs`."""
    names = list(job["signature"])
    attrs = {(names.index(a),): DIVISIBLE_16 for a in job.get("aligned", ())}
    attrs.update({(int(i),): attr for i, attr in job.get("attrs", ())})
    return attrs


def ast_source_class(name: str):
    """The class a "module:attribute" name points at (a job's `ast_source`)."""
    module, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise CompileError(f"ast_source {name!r} names no class: {exc}") from exc


def compile_in_process(job: dict) -> dict[str, bytes]:
    """Compile the job's kernel in this process; Triton's files (cubin, metadata JSON, IRs) by name."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn_name, signature, arch, module_name = job["fn_name"], job["signature"], job["arch"], job["module_name"]
    constexprs = {(int(i),): value for i, value in job.get("constexprs", ())}
    attrs = job_attrs(job)
    with tempfile.TemporaryDirectory(prefix="sparsegen-build-") as tmp:
        path = Path(tmp) / job["source_file"]
        path.write_text(job["source"])
        module = import_module(path, module_name)
        try:
            fn = getattr(module, fn_name)
            if job.get("ast_source"):
                src = ast_source_class(job["ast_source"])(fn, signature, constexprs, attrs)
            else:
                src = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
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
                via = f" (through {job['ast_source']})" if job.get("ast_source") else ""
                raise CompileError(
                    f"Triton failed to compile the kernel {fn_name}{via} for {arch}: "
                    f"{triton_cause(failure, err.text)}\n\n{triton_context(failure)}"
                ) from failure
        finally:
            sys.modules.pop(module_name, None)
    files = {Path(p).name: Path(p).read_bytes() for p in compiled.metadata_group.values()}
    if not any(n.endswith(".cubin") for n in files) or not any(n.endswith(".json") for n in files):
        raise CompileError(f"Triton's build for {arch} lacks a cubin or metadata: {sorted(files)}")
    return files
