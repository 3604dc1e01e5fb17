"""How many Linear layers of timm's ViT families the tracer leaves inside leaf modules (run whole, so
replicated under tensor parallelism), with symbolic tracing and with concrete-shape tracing.

Terms:
  family    -- a timm model module (``timm.models.twins``); one model per variant (the first two words
               of its names: twins_svt, twins_pcpvt) is built, at most PER_FAMILY per family, small / tiny
               names first, pretrained=False, on the meta device, at its default size; its input is its
               ``pretrained_cfg['input_size']``.
  leaf      -- a ``call_module`` node of the traced graph whose module is not a Linear itself; the
               Linear modules inside it (``in leaves``) cannot be split.
  symbolic  -- ``autosplit.trace.trace(model, 1)``: plain torch.fx; timm's registered no-trace modules
               are leaves, a branch on a shape fails.
  concrete  -- ``trace(model, 1, example_inputs=(x,))``: proxies carry meta values, a branch on a shape
               is decided at trace time (and kept as a guard); a timm no-trace module is traced into
               and becomes a leaf only where that fails.

    python benchmarks/leaf_census.py              # one model per family, prints a markdown table
    python benchmarks/leaf_census.py --family twins,convit --all   # every matching model of those
"""
from __future__ import annotations

import argparse
import fnmatch
import inspect
import sys
import time
import warnings
from collections import defaultdict

import torch
from torch import nn

PATTERNS = ("*vit*", "*deit*", "*beit*", "eva*", "*swin*", "xcit*", "cait*", "levit*", "mvit*", "sam*", "pit*",
            "twins*", "crossvit*", "convit*", "tnt*", "volo*", "nest*", "coat*", "gcvit*", "maxvit*", "maxxvit*",
            "davit*", "efficientformer*", "hiera*", "fastvit*", "pvt*", "focalnet*", "nextvit*", "edgenext*",
            "visformer*", "sequencer*", "hgnet*", "repvit*", "shvit*", "iformer*", "swiftformer*", "lowformer*")
PER_FAMILY = 3
SMALL = ("tiny", "small", "nano", "xxs", "_s_", "_s.", "pico", "femto", "_t_")


def families(only: set[str] | None, every: bool) -> dict[str, list[str]]:
    import timm
    from timm.models import get_pretrained_cfg  # noqa: F401  (timm's registry is loaded)
    from timm.models._registry import _model_to_module
    names = sorted({n for p in PATTERNS for n in timm.list_models(p)})
    fams: dict[str, list[str]] = defaultdict(list)
    for n in names:
        fams[_model_to_module[n]].append(n)
    chosen = {}
    for fam, ns in sorted(fams.items()):
        if only and fam not in only:
            continue
        ns = sorted(ns, key=lambda n: (not any(s in n for s in SMALL), n))
        if not every:           # one model per variant (the name's first two words), at most PER_FAMILY
            firsts: dict[str, str] = {}
            for n in ns:
                firsts.setdefault("_".join(n.split("_")[:2]), n)
            ns = list(firsts.values())[:PER_FAMILY]
        chosen[fam] = ns
    return chosen


def census(gm) -> tuple[int, dict[str, int]]:
    """(Linears inside leaves, leaf class -> Linears inside its instances)."""
    inside: dict[str, int] = defaultdict(int)
    for node in gm.graph.nodes:
        if node.op != "call_module":
            continue
        mod = gm.get_submodule(node.target)
        if isinstance(mod, nn.Linear):
            continue
        k = sum(isinstance(m, nn.Linear) for m in mod.modules())
        if k:
            inside[type(mod).__name__] += k
    return sum(inside.values()), dict(inside)


def one(name: str) -> dict:
    import timm
    from autosplit.trace import trace
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = timm.create_model(name, pretrained=False)
    cfg = model.pretrained_cfg
    x = torch.empty(1, *cfg["input_size"], device="meta")
    row = {"model": name, "input": "x".join(map(str, cfg["input_size"][1:])),
           "linears": sum(isinstance(m, nn.Linear) for m in model.modules())}
    modes = {"symbolic": {}}
    if "example_inputs" in inspect.signature(trace).parameters:
        modes["concrete"] = {"example_inputs": (x,)}
    for mode, kw in modes.items():
        t0 = time.perf_counter()
        try:
            gm = trace(model, 1, **kw)
            row[mode] = census(gm)
        except Exception as exc:          # a model the tracer refuses: its first line
            row[mode] = (None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}")
        row[mode + "_s"] = time.perf_counter() - t0
    return row


def _cell(value) -> str:
    n, what = value
    if n is None:
        return f"error ({what})"
    return f"{n}" + (f" ({', '.join(f'{k} {v}' for k, v in sorted(what.items()))})" if what else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", help="comma-separated timm modules (default: every family matched)")
    ap.add_argument("--all", action="store_true", help="every matching model of each family, not one")
    args = ap.parse_args()
    torch.set_num_threads(1)
    fams = families(set(args.family.split(",")) if args.family else None, args.all)
    rows = []
    for fam, names in fams.items():
        for name in names:
            row = one(name)
            row["family"] = fam
            rows.append(row)
            print(f"{fam:28s} {name:45s} {row['linears']:5d} sym {_cell(row['symbolic'])} | "
                  f"conc {_cell(row['concrete']) if 'concrete' in row else '-'}", file=sys.stderr, flush=True)
    has_conc = any("concrete" in r for r in rows)
    print(f"\n{torch.__version__=}; {len(rows)} models of {len(fams)} families\n")
    print("| family | model | input | Linears | in leaves, symbolic | in leaves, concrete |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['model']} | {r['input']} | {r['linears']} | {_cell(r['symbolic'])} | "
              f"{_cell(r['concrete']) if has_conc and 'concrete' in r else '-'} |")
    for mode in ("symbolic", "concrete"):
        done = [r for r in rows if mode in r and r[mode][0] is not None]
        if done:
            total, left = sum(r["linears"] for r in done), sum(r[mode][0] for r in done)
            fams_hit = len({r["family"] for r in done if r[mode][0]})
            secs = sum(r[mode + "_s"] for r in done)
            print(f"\n{mode}: {left} of {total} Linears inside leaves ({100 * left / max(total, 1):.1f}%), "
                  f"in {fams_hit} families; {len(rows) - len(done)} models not traced; {secs:.1f} s tracing")


if __name__ == "__main__":
    main()
