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
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"autosplit"}, tops
