"""Plans of ViT-B/16 at tp = 2, 4, 8 in every tp mode, dumped to compare two versions of autosplit.

A refactor that must not change any plan (issue 49's op registry) is checked by dumping with the old
install and the new one, then comparing:

    PYTHONPATH=/tmp/old_site python benchmarks/plan_identity.py dump /tmp/plans_old
    python benchmarks/plan_identity.py dump /tmp/plans_new
    python benchmarks/plan_identity.py compare /tmp/plans_old /tmp/plans_new

A plan is ``plan.to_dict()`` as JSON, with the memory addresses Python prints in a function's repr
removed (they differ between processes, nothing else may).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

CASES = [("1d", t, {}) for t in (2, 4, 8)] + [("1d-sp", t, {"sequence_parallel": True}) for t in (2, 4, 8)] + \
        [("2d", 4, {"tp_mode": "2d"}), ("2.5d", 8, {"tp_mode": "2.5d", "tp_depth": 2}), ("3d", 8, {"tp_mode": "3d"})] + \
        [("auto", t, {"tp_mode": "auto"}) for t in (2, 4, 8)]
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def dump(out: Path) -> None:
    import timm
    import torch

    import autosplit
    out.mkdir(parents=True, exist_ok=True)
    print(f"autosplit from {autosplit.__file__}", file=sys.stderr)
    for name, tp, kw in CASES:
        with torch.device("meta"):
            model = timm.create_model("vit_base_patch16_224", pretrained=False)
        t0 = time.perf_counter()
        plan = autosplit.compile(model, mesh=(2, tp, 1), example_input=torch.empty(8, 3, 224, 224, device="meta"),
                                 **kw)
        text = json.dumps(plan.to_dict(), indent=1, sort_keys=True, default=str)
        (out / f"{name}-{tp}.json").write_text(_ADDRESS.sub("", text))
        print(f"{name:6} tp={tp}  {time.perf_counter() - t0:5.1f} s", file=sys.stderr)


def compare(a: Path, b: Path) -> int:
    differ = 0
    for f in sorted(a.glob("*.json")):
        same = (b / f.name).exists() and f.read_text() == (b / f.name).read_text()
        differ += not same
        print(f"{f.stem:10} {'identical' if same else 'DIFFERENT'}")
    return 1 if differ else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("dump").add_argument("out", type=Path)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = p.parse_args()
    sys.exit(dump(args.out) if args.cmd == "dump" else compare(args.a, args.b))
