"""No module of ``apexw_hf`` imports one that imports it back (issue 28: the engines behind one interface, no circle).

The test reads the import statements with ``ast`` (nothing is imported), resolves relative and absolute imports of
``apexw_hf`` modules to the module they name, and fails on any cycle between modules, listing it; and on any import
of a module of a higher layer (issue 43: formats -> engines -> optim -> integrations/recipe, see ``LAYERS``), listing
each such edge.

What counts as an edge ``a -> b``:

- Every ``import`` / ``from ... import`` statement anywhere in ``a``: at module level, and also inside functions,
  methods and ``if TYPE_CHECKING:`` blocks. A lazy import is still a dependency (it runs on the first call, and a
  circle through it means that neither module can be read, tested or moved without the other); a circle from the
  optimizer's base class through two engines and back can consist only of function-level imports, and break nothing
  at import time, which is exactly why it would go unnoticed.
- ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg``.
- Executing the parent packages' ``__init__`` on the way (``import apexw_hf.optim.base`` runs ``apexw_hf/__init__``
  first) does not count: ``apexw_hf/__init__`` imports the public names from everywhere by design, so every module
  would be in one circle with it, and that order is Python's, not a dependency the importing module chose.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "apexw_hf"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """``name``, or its longest prefix that is a module of the package (``a.b.attr`` -> ``a.b``)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                resolved = _resolve(target, modules)
                if resolved is not None and resolved != mod:
                    edges.add(resolved)
        graph[mod] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``[a, b, ..., a]``) per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)

    cycles = []
    for comp in components:
        start = min(comp)
        # shortest path back to start inside the component (breadth first)
        prev = {start: None}
        queue = [start]
        end = None
        while queue and end is None:
            v = queue.pop(0)
            for w in sorted(graph[v] & comp):
                if w == start:
                    end = v
                    break
                if w not in prev:
                    prev[w] = v
                    queue.append(w)
        path = []
        while end is not None:  # end, its predecessor, ..., start
            path.append(end)
            end = prev[end]
        cycles.append(path[::-1] + [start])
    return cycles


def test_the_resolver_sees_relative_absolute_and_lazy_imports():
    graph = import_graph()
    assert "apexw_hf.reference" in graph["apexw_hf.optim.base"]  # from .. import reference as ref
    assert "apexw_hf.optim.base" in graph["apexw_hf.optim.compact"]  # from .base import ApexW
    assert "apexw_hf.accounting" in graph["apexw_hf.optim.base"]  # inside a method
    assert "apexw_hf.optim" in graph["apexw_hf.integrations.accelerate"]  # from ..optim import ApexW (a name)


def test_find_cycles_lists_the_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles between apexw_hf modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


# The modules' former paths (before the engines/ folder): the package has no release, so none is kept as an alias.
FORMER_PATHS = (
    "apexw_hf.kernels",
    "apexw_hf.optim.engine",
    "apexw_hf.optim.torch_engine",
    "apexw_hf.optim.torch_passes",
    "apexw_hf.optim.numba_engine",
)


def test_former_import_paths_are_gone():
    # read from the files (not imported): an editable install of another checkout may still answer the old names
    graph = import_graph()
    assert not [old for old in FORMER_PATHS if old in graph]


def test_importing_the_package_imports_no_engine():
    """The engines are imported on an optimizer's first step: ``import apexw_hf`` loads neither triton nor numba (so
    ``TRITON_INTERPRET`` set after it still applies) nor any engine module."""
    code = (
        "import sys, apexw_hf; "
        "print(sorted(m for m in sys.modules if m in ('triton', 'numba') or m.startswith('apexw_hf.engines.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


# Issue 43: the layers, lowest first. A module may import modules of its own layer or of lower ones, never of a higher
# one (counting imports inside functions, as above). ``apexw_hf/__init__`` (the package) is above them all: it
# re-exports the public names.
LAYERS = (
    # 0: below the engines: the numerics, the random streams, the state layouts, hyperparameters, FSDP2 shards
    (
        "apexw_hf._random",
        "apexw_hf.reference",
        "apexw_hf.provenance",
        "apexw_hf.formats",
        "apexw_hf.hparams",
        "apexw_hf.dtensor",
        "apexw_hf.accounting",
    ),
    ("apexw_hf.engines",),  # 1: what computes the update
    ("apexw_hf.optim",),  # 2: the torch.optim.Optimizer classes
    ("apexw_hf.integrations", "apexw_hf.recipe"),  # 3: what uses the optimizers
)
EXEMPT = {"apexw_hf"}
# Upward imports that are known and not yet removed, each with its reason: (importer, imported). Empty: keep it so.
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The layer of ``module``: that of the entry equal to it or to one of its parent packages."""
    for i, names in enumerate(layers):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def upward_edges(graph: dict[str, set[str]], layers=LAYERS, exempt=EXEMPT) -> list[tuple[str, str]]:
    """The edges ``a -> b`` of ``graph`` where ``b`` is of a higher layer than ``a`` (the exempt modules aside)."""
    out = []
    for a in sorted(graph):
        if a in exempt:
            continue
        for b in sorted(graph[a]):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if b not in exempt and la is not None and lb is not None and lb > la:  # no layer: the test below
                out.append((a, b))
    return out


def test_upward_edges_lists_each_one():
    layers = (("p.low",), ("p.mid",), ("p.top",))
    graph = {
        "p.low.x": {"p.mid", "p.low.y"},
        "p.low.y": set(),
        "p.mid": {"p.low.x", "p.top.z"},
        "p.top.z": {"p.low.y"},
    }
    assert upward_edges(graph, layers, set()) == [("p.low.x", "p.mid"), ("p.mid", "p.top.z")]
    assert layer_of("p.mid.sub", layers) == 1 and layer_of("p.middle", layers) is None


def test_every_module_has_a_layer():
    assert not [m for m in import_graph() if m not in EXEMPT and layer_of(m) is None]


def test_no_module_imports_a_higher_layer():
    graph = import_graph()
    edges = [e for e in upward_edges(graph) if e not in ALLOWED_UPWARD]
    assert not edges, "imports of a higher layer (see LAYERS in tests/test_imports.py):\n" + "\n".join(
        f"{a} (layer {layer_of(a)}) -> {b} (layer {layer_of(b)})" for a, b in edges
    )
    assert not ALLOWED_UPWARD - set(upward_edges(graph)), "ALLOWED_UPWARD lists edges that are gone: remove them"
