"""The Triton toolchain: compile one @triton.jit kernel of a rendered module ahead of time (here
or in a build worker, `triton_compile.compile_in_process` either way), and load the stored
result back. Knows nothing about sparsity patterns or templates
(those live in `sparsegen.kernels.*_template`).

`aot_compile` compiles for an arch without a GPU through
`triton.compile(ASTSource(...), target=GPUTarget(...))`; the cubin and Triton's metadata JSON are
what a cache entry stores, and `load_compiled` turns them back into a launchable
`CompiledKernel` with no recompilation. Under TRITON_INTERPRET=1 an entry holds only the module
source, and `load_interpreted` imports its @triton.jit kernel.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from . import build_workers
from .triton_compile import compile_in_process, import_module


def aot_compile(
    source: str,
    *,
    fn_name: str,
    signature: dict[str, str],
    aligned: tuple[str, ...] = (),
    arch: str,
    options: dict[str, int],
    module_name: str,
    source_file: str,
    ast_source: str | None = None,
    constexprs: dict[int, object] | None = None,
    attrs: dict[int, list] | None = None,
) -> dict[str, bytes]:
    """Compile `fn_name` of the rendered module for `arch` (no GPU needed); Triton's files by name.

    `signature` maps argument names (in order) to Triton types ("constexpr" for compile-time
    arguments, whose values `constexprs` gives by argument index); the `aligned` ones are
    compiled as divisible by 16, which the launcher must guarantee, and `attrs` gives any other
    argument's Triton attributes by index. `ast_source`: "module:attribute" of the AST
    source class for a kernel that is not `@triton.jit` (Gluon's). Inside
    `build_workers.using(...)` the build runs in a worker process (the same function)."""
    job = {"source": source, "fn_name": fn_name, "signature": dict(signature), "aligned": list(aligned),
           "arch": arch, "options": dict(options), "module_name": module_name, "source_file": source_file,
           "ast_source": ast_source, "constexprs": sorted([i, v] for i, v in (constexprs or {}).items()),
           "attrs": sorted([i, a] for i, a in (attrs or {}).items())}  # fmt: skip
    workers = build_workers.current()
    return workers.compile(job) if workers is not None else compile_in_process(job)


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
