"""The wheel holds every package of the source tree, under ``autosplit``, and nothing else."""
import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTALLED_AS = {"autosplit": "autosplit", "passes": "autosplit/passes", "cost_model": "autosplit/cost_model"}


def _source_packages() -> set[str]:
    """Every directory with an __init__.py under autosplit/, passes/, cost_model/, as its wheel path."""
    found = set()
    for top, target in INSTALLED_AS.items():
        for init in (ROOT / top).rglob("__init__.py"):
            found.add(str(pathlib.PurePosixPath(target, *init.parent.relative_to(ROOT / top).parts)))
    return found


def test_wheel_holds_every_package_and_no_stray_top_level(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path)], check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("autosplit-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    in_wheel = {n.rpartition("/")[0] for n in names if n.endswith("/__init__.py")}
    assert _source_packages() <= in_wheel, sorted(_source_packages() - in_wheel)
    assert {"autosplit/tp", "autosplit/schedule", "autosplit/runtime", "autosplit/profiling", "autosplit/passes",
            "autosplit/cost_model"} <= in_wheel
    assert "autosplit/profiling/device_bench.py" in names and "autosplit/cost_model/profile_file.py" in names
    assert {"autosplit/report/html.js", "autosplit/report/html.css"} <= set(names)   # report.html's assets
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "LICENSE not in the wheel"
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"autosplit"}, tops


# --- dependencies declared = imported --------------------------------------------------------------------
# Where each requirement is imported: the installed library (autosplit/, passes/, cost_model/) needs
# `dependencies`; examples/ needs `examples` on top; tests/ needs `dev` on top of both.
DIST_OF_MODULE = {"PIL": "pillow"}          # import name -> distribution name, where they differ
PROVIDED_BY = {"pillow": "torchvision"}     # imported, but installed with a declared requirement


def _third_party_imports(*folders: str) -> set[str]:
    """Top-level modules imported (anywhere, lazily too) by the .py files under ``folders``, less the
    standard library and our own packages."""
    import ast
    ours = {"autosplit", "passes", "cost_model", "tests", "benchmarks", "examples"}
    ours |= {p.stem for p in (ROOT / "benchmarks").glob("*.py")}     # a benchmark script imported as a sibling
    found = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    found = {DIST_OF_MODULE.get(m, m) for m in found - ours - set(sys.stdlib_module_names)}
    return found - {"_pytest"} - ({"pytest"} if "tests" not in folders else set())


def _declared() -> dict[str, set[str]]:
    import re
    import tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower() for r in reqs}
    extras = {k: names(v) for k, v in project["optional-dependencies"].items()}
    return {"library": names(project["dependencies"]), **extras}


def test_dependencies_declared_are_the_ones_imported():
    declared = _declared()
    library = _third_party_imports("autosplit", "passes", "cost_model")
    examples = _third_party_imports("examples") - library
    tests = _third_party_imports("tests") - library - examples - {"setuptools"}
    assert library == declared["library"], (sorted(library), sorted(declared["library"]))
    assert examples - {p for p, by in PROVIDED_BY.items() if by in declared["examples"]} <= declared["examples"]
    assert declared["examples"] <= examples | library, "an examples extra nothing in examples/ imports"
    needed_by_tests = tests - {p for p, by in PROVIDED_BY.items() if by in declared["dev"]}
    assert needed_by_tests <= declared["dev"], sorted(needed_by_tests - declared["dev"])
    # the tests build a wheel without build isolation (setuptools) and run the examples
    assert {"setuptools"} | declared["examples"] <= declared["dev"]

