"""The tree's shape (DESIGN §7): no circles between files, no arrow running back up the layers,
modules of at most 400 lines, no file-name prefix standing in for a folder, no history notes.

Every import of a sparsegen module counts as an arrow from the importing file to the file it
loads: at module level, inside functions, under `if TYPE_CHECKING:`, and a module named by a
string to `importlib.import_module` (a plug-in registry, the CLI's commands). `from . import x`
points at `x` when `x` is a module, else at the package's `__init__.py`. Importing `a.b` also
runs `a/__init__.py`; that implicit step is not an arrow, or a package whose `__init__` imports
its own submodules would be a circle by construction.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path


def _repo_root() -> Path:
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file() and (folder / "sparsegen").is_dir():
            return folder
    raise AssertionError(f"no repository root (pyproject.toml + sparsegen/) above {__file__}")


ROOT = _repo_root()
PACKAGE = "sparsegen"
MAX_LINES = 400

# DESIGN §7's layers, bottom to top, each with the modules (and packages: a name covers its
# submodules) that form it, relative to `sparsegen` ("" is `sparsegen/__init__.py`). A file may
# import files of its own layer (without a circle) and of the layers below, never one above.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("support", ("errors", "log", "env", "dtypes", "jsonio", "folders", "utf8")),
    ("specs", ("spec", "presets", "hf_config", "layout", "validate")),
    ("jit", ("jit",)),
    ("kernels", ("kernels",)),
    ("toolkit front", ("reference", "ops", "flex", "figure", "testing", "hf")),
    ("models", ("models",)),
    ("request", ("request",)),  # what every layer above hands down: SamplingParams, Sequence, Plan
    ("runner", ("runner",)),  # one model on one device: KV cache, CUDA graphs, device sampler
    ("parallel", ("parallel",)),  # ranks that each run a runner over a shard; their executor
    ("engine", ("engine",)),  # scheduler and LLMEngine over an executor, blind to the ranks
    ("llm", ("llm",)),
    ("public names", ("",)),  # `sparsegen.X`, loaded on first use: `sparsegen.LLM` included
    ("serve", ("serve",)),
    ("cli", ("cli", "__main__", "commands")),
)

# Top-level files that other work in flight moves into a folder, each with the layer it belongs
# to (the lead deletes an entry once its file is gone).
MOVING: dict[str, str] = {
    "tokenizer": "llm",
}

# Known offenders that other work in flight removes; the lead empties these at merge time.
# Each entry must still be true (a fixed one fails the test until it is deleted here), and
# nothing outside them may be: a new circle, back arrow, prefix file or note fails at once.
# Arrows (importer -> imported) that close a circle or run back up a layer:
ALLOWED_ARROWS: frozenset[tuple[str, str]] = frozenset(
    {
        # back arrows
    }
)
# Top-level modules whose name prefix stands in for a folder (engine moves them):
ALLOWED_PREFIX_FILES: frozenset[str] = frozenset()
# Files that still carry session / call / date notes (their owners remove them):
ALLOWED_HISTORY: frozenset[str] = frozenset({})

HISTORY = re.compile(r"\b(?:sessions?|calls?)\s+\d+|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)


@dataclass(frozen=True)
class Arrow:
    source: str  # importing module, relative to `sparsegen` ("" is the package itself)
    target: str  # imported module
    line: int

    def __str__(self) -> str:
        return f"{self.source or PACKAGE} -> {self.target or PACKAGE} (line {self.line})"


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by its name relative to `sparsegen`."""
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT / PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _absolute(source: str, level: int, name: str | None) -> str:
    """`from <level dots><name> import ...` in module `source`, as a dotted absolute name."""
    base = [PACKAGE, *source.split(".")] if source else [PACKAGE]
    if not _is_package(source):
        base = base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _relative(absolute: str) -> str | None:
    """`sparsegen.a.b` -> "a.b"; None for a module outside the package."""
    if absolute == PACKAGE:
        return ""
    if absolute.startswith(PACKAGE + "."):
        return absolute[len(PACKAGE) + 1 :]
    return None


def _is_import_module(call: ast.Call) -> bool:
    func = call.func
    if isinstance(func, ast.Attribute):
        return (
            func.attr == "import_module" and isinstance(func.value, ast.Name) and func.value.id == "importlib"
        )
    return False


def _named_modules(tree: ast.Module, source: str, relative_ok: bool) -> list[tuple[str, int]]:
    """String constants in the file that name one of the package's modules (a registry)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text = node.value
            if relative_ok and text.startswith(".") and not text.startswith(".."):
                text = _absolute(source, 1, text[1:])
            name = _relative(text)
            if name is not None and name in modules():
                found.append((name, node.lineno))
    return found


def _dynamic(call: ast.Call, tree: ast.Module, source: str) -> list[tuple[str, int]]:
    """What `importlib.import_module(...)` may load: a literal name, every module of a package
    for an f-string `"sparsegen.pkg.{x}"`, else every module the file names in a string."""
    arg = call.args[0] if call.args else None
    relative_ok = len(call.args) > 1
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        text = _absolute(source, 1, arg.value[1:]) if relative_ok and arg.value.startswith(".") else arg.value
        name = _relative(text)
        return [(name, call.lineno)] if name is not None else []
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = _relative(str(arg.values[0].value).rstrip("."))
        if prefix is not None and prefix in modules() and _is_package(prefix):
            inside = [m for m in modules() if m.startswith(prefix + ".") and "." not in m[len(prefix) + 1 :]]
            return [(m, call.lineno) for m in inside]
        return []
    return _named_modules(tree, source, relative_ok)


def _targets(node: ast.AST, tree: ast.Module, source: str) -> list[tuple[str, int]]:
    if isinstance(node, ast.Import):
        return [(n, node.lineno) for a in node.names if (n := _relative(a.name)) is not None]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(source, node.level, node.module) if node.level else node.module
        name = _relative(base or "")
        if name is None:
            return []
        out = []
        for alias in node.names:
            sub = f"{name}.{alias.name}" if name else alias.name
            out.append((sub if sub in modules() else name, node.lineno))
        return out
    if isinstance(node, ast.Call) and _is_import_module(node):
        return _dynamic(node, tree, source)
    return []


@cache
def arrows() -> tuple[Arrow, ...]:
    """Every arrow between two different files of the package (the first line that draws it)."""
    seen: dict[tuple[str, str], Arrow] = {}
    for source, path in modules().items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target, line in _targets(node, tree, source):
                assert target in modules(), f"{path}:{line} imports {PACKAGE}.{target}, which does not exist"
                if target != source:
                    arrow = Arrow(source, target, line)
                    if (source, target) not in seen or line < seen[source, target].line:
                        seen[source, target] = arrow
    return tuple(sorted(seen.values(), key=lambda a: (a.source, a.target)))


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer that holds `module` (its longest matching name)."""
    names = {layer: i for i, (layer, _) in enumerate(LAYERS)}
    best, best_len = None, -1
    entries = [(name, i) for i, (_, names_) in enumerate(LAYERS) for name in names_]
    entries += [(name, names[layer]) for name, layer in MOVING.items()]
    for name, index in entries:
        covers = module == name or (name and module.startswith(name + "."))
        if covers and len(name) > best_len:
            best, best_len = index, len(name)
    assert best is not None, (
        f"{PACKAGE}.{module} belongs to no layer: add it to LAYERS where DESIGN §7 puts it"
    )
    return best


def _cycle_through(start: str, graph: dict[str, list[Arrow]], members: set[str]) -> list[Arrow]:
    """One circle through `start` inside a strongly connected set (breadth-first: the shortest)."""
    paths = {start: []}
    todo = [start]
    while todo:
        node = todo.pop(0)
        for arrow in graph.get(node, []):
            if arrow.target == start:
                return paths[node] + [arrow]
            if arrow.target in members and arrow.target not in paths:
                paths[arrow.target] = paths[node] + [arrow]
                todo.append(arrow.target)
    raise AssertionError(f"no circle through {start}")


def _graph(edges: list[Arrow]) -> dict[str, list[Arrow]]:
    graph: dict[str, list[Arrow]] = {}
    for arrow in edges:
        graph.setdefault(arrow.source, []).append(arrow)
    return graph


def tangles(edges: list[Arrow]) -> list[set[str]]:
    """The groups of two or more files that reach each other (Tarjan's strongly connected
    components): an arrow lies on a circle iff both its ends are in one group."""
    graph = _graph(edges)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for arrow in graph.get(node, []):
            if arrow.target not in index:
                visit(arrow.target)
                low[node] = min(low[node], low[arrow.target])
            elif arrow.target in on_stack:
                low[node] = min(low[node], index[arrow.target])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def circles(edges: list[Arrow]) -> list[list[Arrow]]:
    """One circle (the shortest through its first file) for each tangled group."""
    graph = _graph(edges)
    return [_cycle_through(min(group), graph, group) for group in tangles(edges)]


def _describe(circle: list[Arrow]) -> str:
    return " -> ".join(
        [circle[0].source or PACKAGE] + [f"{a.target or PACKAGE} (line {a.line})" for a in circle]
    )


def test_the_graph_sees_every_kind_of_import():
    """The collector itself: lazy imports, `from . import module`, registries and the CLI's
    f-string all draw arrows (a collector that missed them would pass any tree)."""
    drawn = {(a.source, a.target) for a in arrows()}
    assert ("cli", "errors") in drawn  # module level
    assert ("cli", "commands.show") in drawn  # importlib.import_module(f"sparsegen.commands.{name}")
    assert ("", "reference") in drawn  # sparsegen/__init__.py's table of lazily loaded names
    assert ("ops", "kernels.prefill") in drawn  # inside a function
    assert ("presets", "jsonio") in drawn  # `from . import jsonio` points at the module
    assert len(drawn) > 200


def test_circles_are_found_and_named():
    """The circle finder itself, on a made-up graph: a -> b -> c -> a, with d hanging off c."""
    edges = [Arrow("a", "b", 1), Arrow("b", "c", 2), Arrow("c", "a", 3), Arrow("c", "d", 4)]
    assert [sorted(g) for g in tangles(edges)] == [["a", "b", "c"]]
    assert _describe(circles(edges)[0]) == "a -> b (line 1) -> c (line 2) -> a (line 3)"
    assert circles(edges[:2] + edges[3:]) == []
    assert layer_of("kernels.decode") < layer_of("models.attention") < layer_of("commands.bench.common")


def test_no_circles_between_files():
    edges = [a for a in arrows() if (a.source, a.target) not in ALLOWED_ARROWS]
    found = circles(edges)
    assert not found, "import circles between files:\n" + "\n".join(_describe(c) for c in found)


def test_no_arrow_runs_back_up_the_layers():
    back = [
        a
        for a in arrows()
        if layer_of(a.source) < layer_of(a.target) and (a.source, a.target) not in ALLOWED_ARROWS
    ]
    lines = [f"{a}: {LAYERS[layer_of(a.source)][0]} below {LAYERS[layer_of(a.target)][0]}" for a in back]
    assert not back, "imports that run back up DESIGN §7's layers:\n" + "\n".join(lines)


def package_of(module: str) -> str:
    """The top-level package that holds `module` (`kernels.linear.gemv` -> `kernels`); a file
    directly in `sparsegen/` stands alone."""
    return module.split(".")[0]


def test_no_two_packages_import_each_other():
    """Package level: with every file's arrow drawn between the top-level packages that hold its
    ends, no packages reach each other (`parallel` imports `runner`, so nothing in `runner` may
    import `parallel`, lazily or not)."""
    assert (package_of("engine.engine"), package_of("kernels.linear.gemv")) == ("engine", "kernels")
    assert (package_of("llm"), package_of("parallel"), package_of("")) == ("llm", "parallel", "")
    drawn: dict[tuple[str, str], Arrow] = {}  # package -> package: the first file arrow behind it
    for a in arrows():
        pair = (package_of(a.source), package_of(a.target))
        if pair[0] != pair[1] and (a.source, a.target) not in ALLOWED_ARROWS:
            drawn.setdefault(pair, a)
    found = circles([Arrow(s, t, a.line) for (s, t), a in drawn.items()])
    lines = [" -> ".join(f"[{drawn[x.source, x.target]}]" for x in circle) for circle in found]
    assert not found, "packages that import each other:\n" + "\n".join(lines)


def test_every_allowed_arrow_is_still_drawn():
    drawn = {(a.source, a.target) for a in arrows()}
    gone = sorted(ALLOWED_ARROWS - drawn)
    assert not gone, f"fixed: delete these from ALLOWED_ARROWS: {gone}"
    # an allowed arrow must be an offence: part of a circle or a back arrow
    groups = tangles(list(arrows()))
    harmless = sorted(
        (s, t)
        for s, t in ALLOWED_ARROWS
        if layer_of(s) >= layer_of(t) and not any(s in g and t in g for g in groups)
    )
    assert not harmless, f"neither a circle nor a back arrow: delete from ALLOWED_ARROWS: {harmless}"


def _checked_files() -> list[Path]:
    files = [p for p in (ROOT / PACKAGE).rglob("*") if p.is_file() and p.suffix == ".py"]
    files += [p for p in (ROOT / "templates").rglob("*") if p.is_file()]
    return sorted(files)


def test_modules_and_templates_stay_small():
    long = {}
    for path in _checked_files():
        n = len(path.read_text().splitlines())
        if n > MAX_LINES:
            long[str(path.relative_to(ROOT))] = n
    assert _checked_files() and not long, f"over {MAX_LINES} lines: {long}"


def test_no_file_name_prefix_stands_in_for_a_folder():
    top = sorted(p.name for p in (ROOT / PACKAGE).glob("*.py") if not p.name.startswith("__"))
    packages = {p.name for p in (ROOT / PACKAGE).iterdir() if (p / "__init__.py").is_file()}
    prefixes = [name.split("_")[0] for name in top if "_" in name]
    shared = {p for p in prefixes if prefixes.count(p) > 1 or p in packages}
    offenders = {name for name in top if name.startswith("tp_") or name.split("_")[0] in shared}
    assert offenders <= ALLOWED_PREFIX_FILES, (
        f"a prefix standing in for a folder: {sorted(offenders - ALLOWED_PREFIX_FILES)}"
    )
    fixed = sorted(ALLOWED_PREFIX_FILES - offenders)
    assert not fixed, f"fixed: delete these from ALLOWED_PREFIX_FILES: {fixed}"


def test_code_records_design_not_history():
    noted = {}
    for path in [*_checked_files(), ROOT / "README.md"]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                noted.setdefault(str(path.relative_to(ROOT)), []).append(f"{number}: {line.strip()[:100]}")
    new = {f: lines for f, lines in noted.items() if f not in ALLOWED_HISTORY}
    assert not new, "session / call / date notes:\n" + "\n".join(
        f"{f}:{ln}" for f, lines in new.items() for ln in lines
    )
    fixed = sorted(ALLOWED_HISTORY - set(noted))
    assert not fixed, f"fixed: delete these from ALLOWED_HISTORY: {fixed}"
