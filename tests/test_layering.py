"""The layers, checked: each imports alone without loading the layers above it, and no import cycles.

Layers, bottom to top (an arrow: may import):

    errors, mesh  <-  schedule  <-  passes, cost_model, tp.ops  <-  compiler, plan (+ report, dump)
                                                                        <-  runtime  <-  autosplit (lazy names)

Planning is pure: nothing below the runtime loads ``autosplit.runtime``; the package's public names
load on first use (PEP 562), so ``import autosplit.cost_model`` does not pull in the compiler.
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
    "autosplit.cost_model": ["autosplit.runtime", "autosplit.compiler", "autosplit.plan", "autosplit.schedule"],
    "autosplit.tp.ops": ["autosplit.runtime", "autosplit.compiler", "autosplit.passes", "autosplit.cost_model"],
    "autosplit.passes.sharding.megatron": ["autosplit.runtime", "autosplit.compiler", "autosplit.plan"],
    "autosplit.passes.sharding.grid": ["autosplit.runtime", "autosplit.compiler", "autosplit.plan"],
    "autosplit.passes.tp_random": ["autosplit.runtime", "autosplit.compiler", "autosplit.plan"],
    "autosplit.plan": ["autosplit.runtime", "autosplit.compiler"],
    "autosplit.compiler": ["autosplit.runtime"],
}


def _loaded_after(module: str) -> list[str]:
    code = (f"import sys, json, {module}; "
            f"print(json.dumps(sorted(m for m in sys.modules if m == 'autosplit' or m.startswith('autosplit.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/", timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", list(LAYERS))
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


def _imports(tree: ast.AST, known: set[str], package: str) -> set[str]:
    """Our modules a file imports (``package``: the file's package, for relative imports), at any
    depth, except under ``if TYPE_CHECKING:``."""
    found = set()

    def visit(node):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
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
    files = [p for root in PACKAGES.values() for p in root.rglob("*.py")]
    names = {_module_name(p): p for p in files}
    graph = nx.DiGraph()
    for name, path in names.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for target in _imports(ast.parse(path.read_text()), set(names), package):
            package_init = name.rsplit(".", 1)[0] == target and path.name == "__init__.py"
            if target != name and not package_init:
                graph.add_edge(name, target)
    cycles = [c for c in nx.simple_cycles(graph) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles[:5]}"
    assert graph.number_of_edges() > 50          # the scan really saw the imports
