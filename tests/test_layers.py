"""The layering of DESIGN.md §2, checked over the source: data flows one way, so a module imports
only modules of its own layer or of layers to its left (lazy imports inside functions included),
and no two modules import each other through any chain (imports for type annotations alone do
not count: they never run)."""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent / "torchnative"

# left to right; a module imports only from its own layer or those before it
LAYERS = [
    {"ir", "sizes", "events", "interface", "toolchain", "remote", "store", "grad", "quiet", "threads", "lru"},  # what every layer shares
    {"shim"}, {"recording"}, {"passes"}, {"partitioner"}, {"delegates"}, {"build"}, {"cache"}, {"replay"}, {"bundle"}, {"inspector"},
    {"models", "cli", ""},  # "": the public API, torchnative/__init__.py
]


def _modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = ("torchnative", *path.relative_to(ROOT).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The torchnative modules `name` imports: `from package import submodule` names the
    submodule, `from module import thing` the module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("torchnative")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if not base.startswith("torchnative"):
                continue
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    return out - {name}


def _walk(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:` (imports for annotations, never run)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.If) and isinstance(child.test, ast.Name) and child.test.id == "TYPE_CHECKING":
            continue
        yield child
        yield from _walk(child)


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    return next(i for i, names in enumerate(LAYERS) if top in names)


def _graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        g.add_edges_from((name, target) for target in _imports(name, path, modules))
    return g


def test_every_module_has_a_layer():
    for name in _modules():
        _layer(name)  # raises StopIteration for a top-level module no layer names


def test_no_import_goes_to_a_layer_on_the_right():
    wrong = [(a, b) for a, b in _graph().edges if _layer(b) > _layer(a)]
    assert not wrong, "imports against the layering (module -> module on its right):\n" + "\n".join(f"{a} -> {b}" for a, b in wrong)


def test_no_import_cycle():
    cycles = list(nx.simple_cycles(_graph()))
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles)


def test_the_checks_see_a_wrong_import(tmp_path):
    """The rule itself: an import of runtime from the partitioner is caught."""
    source = "from torchnative.build import disk_cache\n"
    modules = {"torchnative.partitioner.bad": tmp_path / "bad.py", "torchnative.build.disk_cache": Path()}
    (tmp_path / "bad.py").write_text(source)
    (target,) = _imports("torchnative.partitioner.bad", tmp_path / "bad.py", modules)
    assert target == "torchnative.build.disk_cache" and _layer(target) > _layer("torchnative.partitioner.bad")


# Module-level tables that grow at run time and are not bounded caches (torchnative.lru.Lru objects
# are), each with why it cannot grow with what a process runs. ALL_CAPS tables are constants, filled
# at import (registries, op sets), except those listed here too; a new lower-case table is either
# an Lru or listed here with its reason.
ALLOWED_TABLES = {
    "torchnative.delegates.iree._devices": "one per IREE driver (vulkan, local-task)",
    "torchnative.recording.ops._CLASSES": "one entry per aten op overload: bounded by torch's op set",
    "torchnative.recording.trie.REFS": "one interned slot reference per slot number: bounded by the largest graph",
    "torchnative.passes.pin._pins": "one entry per pinned tensor, dropped with the tensor (weakref)",
    "torchnative.passes.pin._names": "one entry per parameter or buffer of the models given to name_tensors",
    "torchnative.replay.guard._SPECS": "one entry per call structure (positional count, keyword names) of the code run",
    "torchnative.replay.guard._KNOWN": "the same, by spec",
    "torchnative.replay.watch._watched": "one entry per watched module, dropped with the module (weakref)",
    "torchnative.replay.watch._dynamic": "one entry per watched module with a float attribute set between calls, "
                                         "dropped with the module (weakref)",
    "torchnative.store._tables": "one per delegate probe table",
    "torchnative.events._listeners": "listeners registered and removed by the inspector",
    "torchnative.build.program.AROUND": "observers of partition runs, registered and removed by the inspector",
    "torchnative.threads._warned": "one flag",
    "torchnative.cache.program_cache._prepared": "one name per delegate that has a prepare()",
    "torchnative.cache.program_cache._to_prepare": "the same delegates' prepare(), emptied when the compile thread runs them",
    "torchnative.threads._yielded": "one entry per thread that asked for a background compile, dropped at its next "
                                    "call once none runs",
    "torchnative.build.verify._warned": "one entry per delegate",
    "torchnative.quiet._attached": "the log handlers a quiet() block filters, emptied when the last one ends",
    "torchnative.replay.watch._hooks": "two hook handles while any module is watched",
    "torchnative.build.apart._children": "the compile processes running: one per background thread, removed when it ends",
}
_MAKERS = {"dict", "list", "set", "Counter", "defaultdict", "OrderedDict", "deque", "WeakValueDictionary",
           "WeakKeyDictionary"}


def _module_tables(tree: ast.Module) -> list[str]:
    """Names assigned a mutable container at module level (not in a function or class)."""
    found = []
    for node in tree.body:
        targets, value = ([node.target], node.value) if isinstance(node, ast.AnnAssign) else \
            (node.targets, node.value) if isinstance(node, ast.Assign) else ((), None)
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", None)) in _MAKERS)
        found += [t.id for t in targets if mutable and isinstance(t, ast.Name)]
    return found


def _constant(name: str) -> bool:
    return name.strip("_").isupper() or name == "__all__"


def test_every_module_level_table_is_a_bounded_cache_or_says_why_it_cannot_grow():
    tables = {f"{name}.{t}" for name, path in _modules().items() for t in _module_tables(ast.parse(path.read_text()))}
    unexplained = sorted(t for t in tables - set(ALLOWED_TABLES) if not _constant(t.rpartition(".")[2]))
    assert not unexplained, "module-level tables that grow without bound (make them torchnative.lru.Lru, or " \
                            "say in ALLOWED_TABLES why they cannot grow):\n" + "\n".join(unexplained)
    assert not set(ALLOWED_TABLES) - tables, f"ALLOWED_TABLES names tables that are gone: {set(ALLOWED_TABLES) - tables}"
