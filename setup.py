"""Package discovery (everything else is in pyproject.toml).

``passes/`` and ``cost_model/`` live at the top of the repository but install as ``autosplit.passes`` and
``autosplit.cost_model``, so nothing generic lands in site-packages.  Their subpackages, and every
subpackage of ``autosplit/``, are found here rather than listed by hand, so a new one cannot be forgotten;
``tests``, ``benchmarks`` and ``examples`` are never installed.
"""
from setuptools import find_packages, setup

RENAMED = {"passes": "autosplit.passes", "cost_model": "autosplit.cost_model"}   # directory -> package


def packages() -> list[str]:
    found = find_packages(include=["autosplit", "autosplit.*"])
    for directory, package in RENAMED.items():
        found += [package + name.removeprefix(directory)
                  for name in find_packages(include=[directory, directory + ".*"])]
    return sorted(found)


setup(packages=packages(), package_dir={package: directory for directory, package in RENAMED.items()})
