"""Small exchanges between all ranks, for checks that ranks agree (agreement.py, call_gate.py).

Terms:
  row         -- a fixed-length list of int64 values one rank contributes; ``gather_rows`` returns
                 every rank's row with ONE all_gather over WORLD, waited on through the Watchdog, on
                 the world's host-side control group (gloo) when the backend is NCCL, so that reading
                 the rows is no device sync.
  nonce       -- a random 62-bit number each rank puts first in its row, so that every exchange has
                 an id all ranks know (rank 0's nonce) without a counter that could drift.  Drawn from
                 a private random generator: the user's torch / random seeds are not touched.
  texts       -- on the error path only, readable descriptions that ranks share through the store,
                 under keys named by the exchange id; waited on with ``Watchdog.until`` (same deadline).
  stable hash -- a 63-bit hash of a string, the same in every process (unlike Python's ``hash``).
"""
from __future__ import annotations

import hashlib
import os
import random

import torch
import torch.distributed as dist

_RNG = random.Random(os.urandom(16))


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def nonce() -> int:
    return _RNG.getrandbits(62)


def gather_rows(world, watchdog, row: list[int], doing: str) -> list[list[int]]:
    """Every rank's ``row`` (same length everywhere), in rank order, via one all_gather over WORLD."""
    group = world.control_group
    mine = torch.tensor(row, dtype=torch.int64, device="cpu" if group is not None else world.device)
    rows = [torch.empty_like(mine) for _ in range(world.size)]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    watchdog.wait(work, doing, host=True, on_host=group is not None)
    return torch.stack(rows).tolist()          # the check decides on host


def share_texts(world, watchdog, exchange_id: int, text: str, doing: str) -> list[str]:
    """Every rank's ``text``, in rank order; all ranks must call this with the same exchange_id."""
    keys = [f"autosplit/texts/{exchange_id:x}/{r}" for r in range(world.size)]
    world.store.set(keys[world.rank], text)
    watchdog.until(lambda: world.store.check(keys), doing)
    return [world.store.get(k).decode() for k in keys]


def who(ranks: list[int], world=None) -> str:
    """'rank 1' or 'ranks 0, 2'; with ``world``, a single rank also gets its coordinates."""
    if len(ranks) > 1:
        return f"ranks {', '.join(map(str, ranks))}"
    if world is None:
        return f"rank {ranks[0]}"
    c = world.mesh.coord_of(ranks[0])
    return f"rank {ranks[0]} (pp={c.pp}, tp={c.tp}, dp={c.dp})"


def by_value(values: list[str]) -> list[tuple[list[int], str]]:
    """(ranks, value) groups; rank 0's group last, so the odd ones out are named first."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return sorted(((ranks, v) for v, ranks in groups.items()), key=lambda g: g[0][0] == 0)
