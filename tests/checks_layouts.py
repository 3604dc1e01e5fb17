"""Layouts the sharding engine's programs may pick under other prices: every one must lower to per-rank
programs that train equal to one device, or be left out of the program (never refused by the lowering,
never silently wrong).

Terms:
  perturbed prices -- each node's option costs and each edge's transition costs multiplied by a factor
                      drawn from [1/spread, spread] (seeded), so that the solver picks layouts the
                      device profiles of the suite would not (another GPU, a measured CPU profile under
                      load, a changed cost model).  The program's feasibility is untouched: only what is
                      in it is priced differently.
"""
from __future__ import annotations

import contextlib
import random
from unittest import mock

from autosplit.passes.sharding import engine, joint


@contextlib.contextmanager
def perturbed_prices(seed: int, spread: float = 3.0):
    """Inside: every program of the engine (one axis: engine.py; two: joint.py) solved under prices
    perturbed by ``seed``."""
    rng = random.Random(seed)
    solve = joint.solve

    def noisy(costs, edges, must=(), *rest):
        costs = [[c * rng.uniform(1 / spread, spread) for c in row] for row in costs]
        edges = [(e[0], e[1], {k: t * rng.uniform(1 / spread, spread) for k, t in e[2].items()}, *e[3:])
                 for e in edges]
        return solve(costs, edges, must, *rest)

    with mock.patch.object(joint, "solve", noisy), mock.patch.object(engine, "solve", noisy):
        yield


def train_perturbed(names: list[str], seeds: list[int], mesh=(1, 8, 1), tp_mode: str = "3d", **kw) -> dict:
    """On every rank: per seed, tests/checks_zoo.py ``train_zoo`` of ``names`` under perturbed prices
    (``kw``: more parallelize options)."""
    from tests import checks_zoo
    out = {}
    for seed in seeds:
        with perturbed_prices(seed):
            out[seed] = checks_zoo.train_zoo(names, mesh, tp_mode, device="h100", **kw)
    return out


def train_under_perturbed_prices(seed: int, *args, **kw) -> dict:
    """On every rank: tests/dist_checks.py ``train_matches_single_device(*args, **kw)`` with every program
    of the engine solved under prices perturbed by ``seed`` (a layout the suite's profiles do not pick)."""
    from tests.dist_checks import train_matches_single_device
    with perturbed_prices(seed):
        return train_matches_single_device(*args, **kw)
