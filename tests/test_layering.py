"""The layers, checked: each imports alone without loading the layers above it, no import cycles
(``if TYPE_CHECKING:`` imports included), and the runtime's rooms import downward only.

Layers, bottom to top (an arrow: may import):

    errors, mesh  <-  schedule  <-  passes, cost_model, tp.ops  <-  report (presenters)  <-  plan, compiler
        <-  runtime (faults <- stage <- parallel <- state <- pipeline <- entry points)  <-  profiling, check
        <-  autosplit (lazy names)

Planning is pure: nothing below the runtime loads ``autosplit.runtime``; the package's public names
load on first use (PEP 562), so ``import autosplit.cost_model`` does not pull in the compiler.  The
presenters (``autosplit.report``) format the plan they are given and never import ``autosplit.plan``:
the Plan's ``summary()`` / ``dump()`` call them, so the arrow runs one way.  The training runtime never
loads ``autosplit.profiling`` (measuring a machine's profile): no module under autosplit/runtime/
imports it, anywhere in the file, nor through what it imports at module level
(``test_runtime_never_imports_profiling``, a static scan of every runtime module, which
``test_the_profiling_scan_finds_an_indirect_import`` shows can fail).  The rooms' rule
(``test_rooms_import_downward_only``) is shown able to fail by ``test_the_room_check_finds_an_upward_import``.
"""
import ast
import json
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"autosplit": REPO / "autosplit", "autosplit.passes": REPO / "passes",
            "autosplit.cost_model": REPO / "cost_model"}

# module imported alone -> prefixes of our modules it must not load
LAYERS = {
    "autosplit": ["autosplit."],
    "autosplit.errors": ["autosplit.runtime", "autosplit.compiler", "autosplit.passes", "autosplit.cost_model"],
    "autosplit.schedule": ["autosplit.runtime", "autosplit.compiler", "autosplit.passes", "autosplit.cost_model",
                           "autosplit.tp"],
    "autosplit.cost_model": ["autosplit.runtime", "autosplit.compiler", "autosplit.plan", "autosplit.schedule",
                             "autosplit.profiling"],
    "autosplit.tp.ops": ["autosplit.runtime", "autosplit.compiler", "autosplit.passes", "autosplit.cost_model"],
    "autosplit.passes.sharding.megatron": ["autosplit.runtime", "autosplit.compiler", "autosplit.plan"],
    "autosplit.passes.sharding.grid": ["autosplit.runtime", "autosplit.compiler", "autosplit.plan"],
    "autosplit.passes.tp_random": ["autosplit.runtime", "autosplit.compiler", "autosplit.plan"],
    "autosplit.plan": ["autosplit.runtime", "autosplit.compiler"],
    "autosplit.report.dump": ["autosplit.runtime", "autosplit.compiler", "autosplit.plan", "autosplit.strategy"],
    "autosplit.runtime.faults.deadlines": ["autosplit.runtime.stage", "autosplit.runtime.parallel",
                                           "autosplit.runtime.state", "autosplit.runtime.pipeline",
                                           "autosplit.compiler", "autosplit.profiling"],
    "autosplit.compiler": ["autosplit.runtime"],
    "autosplit.runtime.parallelize": ["autosplit.profiling"],
}


def _loaded_after(module: str) -> list[str]:
    code = (f"import sys, json, {module}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m == 'autosplit' or m.startswith('autosplit.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", list(LAYERS))
@pytest.mark.default_cases('autosplit', 'autosplit.errors', 'autosplit.runtime.parallelize')
def test_layer_imports_alone(module):
    loaded = _loaded_after(module)
    assert module in loaded
    wrong = [m for m in loaded if m != module and any(m == p.rstrip(".") or m.startswith(p) for p in LAYERS[module])
             and not module.startswith(m)]
    assert not wrong, f"importing {module} loaded {wrong}"


def _module_name(path: Path) -> str:
    for package, root in PACKAGES.items():
        if root in path.parents or path.parent == root:
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            return ".".join([package] + parts)
    raise ValueError(path)


def _imports(tree: ast.AST, known: set[str], package: str, module_level: bool = False,
             type_checking: bool = False) -> set[str]:
    """Our modules a file imports (``package``: the file's package, for relative imports), at any
    depth; under ``if TYPE_CHECKING:`` only with ``type_checking``; ``module_level``: only those run
    when the module is imported (not inside a function's body)."""
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING" and not type_checking:
            return
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            module = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            if module and module.startswith("autosplit"):
                for a in node.names:
                    sub = f"{module}.{a.name}"
                    found.add(sub if sub in known else module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return {m for m in found if m in known}


def test_no_import_cycles():
    """No cycle among our files, counting imports inside functions and under ``if TYPE_CHECKING:``."""
    graph = import_graph(_repo_sources())
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles[:5]}"
    assert graph.number_of_edges() > 50          # the scan really saw the imports


PROFILING = "autosplit.profiling"


def _is_profiling(module: str) -> bool:
    return module == PROFILING or module.startswith(PROFILING + ".")


def _parents(module: str, known: set[str]) -> list[str]:
    """The packages importing ``module`` runs first (their ``__init__``), those of ours."""
    parts = module.split(".")
    return [p for p in (".".join(parts[:i]) for i in range(1, len(parts))) if p in known]


def profiling_imports_of_runtime(sources: dict[str, tuple[str, bool]]) -> list[str]:
    """Each runtime module that imports autosplit.profiling, as its import chain ("a -> b -> c"), from
    ``sources``: module name -> (its source, whether it is a package's __init__).  Direct: an import
    anywhere in a runtime module's file.  Transitive: through module-level imports (and the packages
    each import runs first), from any module the runtime module imports at module level."""
    known = set(sources)
    trees = {name: ast.parse(src) for name, (src, _) in sources.items()}

    def package(name):
        return name if sources[name][1] else name.rsplit(".", 1)[0]

    at_load = {name: _imports(tree, known, package(name), module_level=True) for name, tree in trees.items()}
    for name in known:
        at_load[name] |= {p for target in set(at_load[name]) for p in _parents(target, known)}
        at_load[name].discard(name)
    found = []
    for name in sorted(n for n in known if n == "autosplit.runtime" or n.startswith("autosplit.runtime.")):
        direct = sorted(m for m in _imports(trees[name], known, package(name)) if _is_profiling(m))
        chain = [name, direct[0]] if direct else _chain_to_profiling(name, at_load)
        if chain:
            found.append(" -> ".join(chain))
    return found


def _chain_to_profiling(start: str, at_load: dict[str, set[str]]) -> list[str] | None:
    """The shortest chain of module-level imports from ``start`` to a profiling module (breadth first,
    in name order), or None."""
    chains, frontier = {start: [start]}, [start]
    while frontier:
        nxt = []
        for module in frontier:
            for target in sorted(at_load[module] - set(chains)):
                chains[target] = chains[module] + [target]
                if _is_profiling(target):
                    return chains[target]
                nxt.append(target)
        frontier = nxt
    return None


def _repo_sources() -> dict[str, tuple[str, bool]]:
    files = [p for root in PACKAGES.values() for p in root.rglob("*.py")]
    return {_module_name(p): (p.read_text(), p.name == "__init__.py") for p in files}


def test_runtime_never_imports_profiling():
    sources = _repo_sources()
    assert "autosplit.runtime.parallelize" in sources and any(_is_profiling(m) for m in sources)
    found = profiling_imports_of_runtime(sources)
    assert not found, f"the training runtime imports autosplit.profiling: {found}"


def test_the_profiling_scan_finds_an_indirect_import():
    """The scan above, on made-up modules: a runtime module importing a helper at module level whose
    package's __init__ imports the profiling package is found, with its chain; an import inside a function
    of a non-runtime module is not followed; one inside a runtime module's function is still found."""
    sources = {
        "autosplit": ("", True),
        "autosplit.runtime": ("", True),
        "autosplit.runtime.ok": ("import torch\nfrom autosplit.helpers.lazy import f\n", False),
        "autosplit.runtime.bad": ("from autosplit.helpers.tool import g\n", False),
        "autosplit.runtime.inside": ("def f():\n    from autosplit.profiling import job\n", False),
        "autosplit.helpers": ("from autosplit.helpers import deep\n", True),
        "autosplit.helpers.deep": ("", False),
        "autosplit.helpers.tool": ("", False),
        "autosplit.helpers.lazy": ("def f():\n    import autosplit.profiling.comm_bench\n", False),
        "autosplit.profiling": ("", True),
        "autosplit.profiling.comm_bench": ("", False),
        "autosplit.profiling.job": ("", False),
    }
    clean = dict(sources, **{"autosplit.runtime.inside": ("", False)})
    assert profiling_imports_of_runtime(clean) == []
    via_package = dict(clean, **{"autosplit.helpers": ("from autosplit.profiling import comm_bench\n", True)})
    assert profiling_imports_of_runtime(via_package) == [
        "autosplit.runtime.bad -> autosplit.helpers -> autosplit.profiling",       # its __init__ runs first
        "autosplit.runtime.ok -> autosplit.helpers -> autosplit.profiling"]
    assert profiling_imports_of_runtime(sources) == ["autosplit.runtime.inside -> autosplit.profiling.job"]


# The runtime's rooms, bottom to top: a module imports modules of its own room and of rooms below it
# only (autosplit/runtime/__init__.py says what lives in each).  The last, the runtime's own top level,
# holds the entry points (parallelize, ParallelModule, planning inside the job).
ROOMS = ["autosplit.runtime.faults", "autosplit.runtime.stage", "autosplit.runtime.parallel",
         "autosplit.runtime.state", "autosplit.runtime.pipeline", "autosplit.runtime"]
# Modules outside the runtime that may import it: the package's lazy public names, the command line,
# measuring a machine (autosplit.profiling runs collectives) and checking a job on it (autosplit.check
# trains through parallelize).  The graph side never does.
RUNTIME_USERS = ("autosplit.__main__", "autosplit.profiling", "autosplit.check")
# The presenters (autosplit.report) format the plan they are given: nothing above the plan's data.
ABOVE_PRESENTERS = ("autosplit.plan", "autosplit.compiler", "autosplit.runtime", "autosplit.strategy",
                    "autosplit.profiling")


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _room(module: str) -> int | None:
    """Index of the runtime room ``module`` lies in (a room's package itself included), else None."""
    inside = [k for k, room in enumerate(ROOMS) if _within(module, room)]
    return min(inside) if inside else None


def import_graph(sources: dict[str, tuple[str, bool]]) -> nx.DiGraph:
    """Module -> module it imports, anywhere in its file, ``if TYPE_CHECKING:`` included."""
    known, graph = set(sources), nx.DiGraph()
    for name, (src, is_package) in sources.items():
        graph.add_node(name)
        package = name if is_package else name.rsplit(".", 1)[0]
        for target in _imports(ast.parse(src), known, package, type_checking=True):
            if target != name and not (is_package and _within(target, name)):
                graph.add_edge(name, target)
    return graph


def arrows_up(graph: nx.DiGraph) -> list[str]:
    """Every import that runs against the layering: a runtime room importing a room above it, the graph
    side importing the runtime, a presenter importing what sits above the plan's data."""
    wrong = []
    for a, b in graph.edges:
        ra, rb = _room(a), _room(b)
        if ra is not None and rb is not None and rb > ra:
            wrong.append(f"{a} -> {b} (room {ROOMS[ra]} imports room {ROOMS[rb]}, above it)")
        elif ra is None and rb is not None and a != "autosplit" and not any(_within(a, u) for u in RUNTIME_USERS):
            wrong.append(f"{a} -> {b} (the graph side imports the runtime)")
        elif _within(a, "autosplit.report") and any(_within(b, p) for p in ABOVE_PRESENTERS):
            wrong.append(f"{a} -> {b} (a presenter imports what sits above the plan's data)")
    return sorted(wrong)


def test_rooms_import_downward_only():
    graph = import_graph(_repo_sources())
    assert {"autosplit.runtime.faults.deadlines", "autosplit.report.summary"} <= set(graph.nodes)
    assert graph.number_of_edges() > 100
    wrong = arrows_up(graph)
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_the_room_check_finds_an_upward_import():
    """arrows_up on made-up modules: a faults module importing the pipeline, a pass importing the runtime
    under TYPE_CHECKING, and a presenter importing the plan are each found; downward imports are not."""
    sources = {
        "autosplit": ("", True), "autosplit.runtime": ("", True),
        "autosplit.runtime.faults": ("", True), "autosplit.runtime.pipeline": ("", True),
        "autosplit.runtime.pipeline.executor": ("from autosplit.runtime.faults import deadlines\n", False),
        "autosplit.runtime.faults.deadlines": ("def f():\n    from autosplit.runtime.pipeline import executor\n",
                                               False),
        "autosplit.passes": ("", True),
        "autosplit.passes.cut": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                 "    from autosplit.runtime.faults import deadlines\n", False),
        "autosplit.report": ("", True), "autosplit.plan": ("from autosplit.report import summary\n", False),
        "autosplit.report.summary": ("from autosplit.plan import Plan\n", False),
    }
    assert arrows_up(import_graph(sources)) == [
        "autosplit.passes.cut -> autosplit.runtime.faults.deadlines (the graph side imports the runtime)",
        "autosplit.report.summary -> autosplit.plan (a presenter imports what sits above the plan's data)",
        "autosplit.runtime.faults.deadlines -> autosplit.runtime.pipeline.executor (room autosplit.runtime.faults "
        "imports room autosplit.runtime.pipeline, above it)"]
