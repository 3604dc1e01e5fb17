"""The per-op costs of every ViT row of the published GPU tables, as the cost model counts them.

Terms:
  table     -- a CSV of ``../shared/reference/gpu-tables/`` (timm's published benchmark runs): training rows
               (forward, backward, SGD step; AMP float16) on an RTX 3090, inference rows (forward, AMP
               float16) on RTX 4090 / 5090 / Pro 6000.  Eager rows only: a ``-dynamo`` table ran
               ``torch.compile``, whose fused kernels the eager model does not describe (issue 37).
  plain ViT -- the rows the tables' README calls plain ViTs: names starting ``vit_``, ``deit``, ``beit``,
               ``eva``, ``flexivit``, ``samvit``.  A name the installed timm does not know is skipped (and
               counted).
  program   -- what the row ran: the timm model at the row's image size, traced by autosplit's passes on
               the meta device (no weights), with float16 autocast under CUDA's autocast lists.  PyTorch
               1.x rows ran timm's unfused attention (``q @ k^T``, softmax, ``@ v``: there was no SDPA);
               2.x rows its fused ``scaled_dot_product_attention``.
  record    -- per graph node that computes: op class (cost_model/measured.py), compute dtype, forward /
               backward FLOPs and bytes, GEMM shape (cost_model/kernels.py).  Every term is affine in the
               batch, so the program is compiled at batch 1 and 2 and each row's batch is extrapolated
               (exact for these models: their graphs do not depend on the batch).
  cache     -- ``$AUTOSPLIT_BENCH_CACHE`` or ``~/.cache/autosplit/gpu_table_features.json``: records per
               (model, image size, fused attention); compiling all of them takes ~10 minutes on 2 cores.
"""
from __future__ import annotations

import csv
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

TABLES = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "gpu-tables"
PLAIN_VIT = re.compile(r"^(vit_|deit|beit|eva|flexivit|samvit)")
GPU_OF = {"rtx3090": "rtx3090", "rtx4090": "rtx4090", "-4090": "rtx4090", "5090": "rtx5090",
          "pro6000maxq": "rtx_pro6000_maxq"}


@dataclass(frozen=True)
class Row:
    table: str
    gpu: str
    train: bool
    model: str
    img: int
    batch: int
    ms: float           # published milliseconds per step / forward pass
    fused: bool         # the program ran fused SDPA (PyTorch 2.x)


def tables_dir() -> Path:
    return Path(os.environ.get("AUTOSPLIT_GPU_TABLES", TABLES))


def rows() -> list[Row]:
    """Every plain-ViT row of the eager tables."""
    out = []
    for path in sorted(tables_dir().glob("benchmark-*.csv")):
        if "dynamo" in path.name:
            continue
        train = "-train-" in path.name
        gpu = next(v for k, v in GPU_OF.items() if k in path.name)
        pre = "train" if train else "infer"
        for r in csv.DictReader(path.open()):
            if PLAIN_VIT.match(r["model"]):
                out.append(Row(path.name, gpu, train, r["model"], int(r[f"{pre}_img_size"]),
                               int(r[f"{pre}_batch_size"]), float(r[f"{pre}_step_time"]), "-pt1" not in path.name))
    return out


def _programs(model: str, img: int, fused: bool):
    """The program's graph with costs at batch 1 and at batch 2 (see *record*), and its parameter bytes
    and tensors.  Traced once; autocast's dtypes (the slow pass: fake tensors) found once at batch 1
    and given to the batch-2 shapes (they do not depend on the batch)."""
    import torch
    import timm
    from torch.utils._pytree import tree_leaves, tree_map
    from autosplit.compiler import plan_state
    from autosplit.cost_model import AnnotateCosts
    from autosplit.options import PlanOptions
    from autosplit.passes.autocast_prop import AutocastDtypeProp
    from autosplit.passes.shape_prop import ExampleShapeProp
    from autosplit.passes.trace_model import TraceModel
    timm.layers.set_fused_attn(fused)
    with torch.device("meta"):
        try:
            m = timm.create_model(model, pretrained=False, img_size=img)
        except TypeError:
            m = timm.create_model(model, pretrained=False)
    inputs = [torch.empty(1, 3, img, img, device="meta")]
    state = plan_state(m, (1, 1, 1), inputs[0], PlanOptions(device="h100", autocast=torch.float16,
                                                            num_microbatches=1))
    gm = TraceModel(state)(m).graph_module
    out = []
    for b in (1, 2):
        xs = [torch.empty(b, 3, img, img, device="meta")]
        gm = ExampleShapeProp(xs, model=m)(gm).graph_module
        if b == 1:
            gm = AutocastDtypeProp(xs, torch.float16, "cuda")(gm).graph_module
            dtypes = {n: [t.dtype for t in tree_leaves(n.meta.get("val")) if isinstance(t, torch.Tensor)]
                      for n in gm.graph.nodes}
        else:
            for n in gm.graph.nodes:
                it = iter(dtypes[n])
                n.meta["val"] = tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=next(it),
                                                                       device="meta")
                                         if isinstance(t, torch.Tensor) else t, n.meta.get("val"))
        for n in gm.graph.nodes:
            n.meta.pop("cost", None)
        gm = AnnotateCosts(state)(gm).graph_module
        out.append(_collect(gm))
    params = sum(p.numel() * p.element_size() for p in m.parameters())
    return out[0], out[1], params, sum(1 for _ in m.parameters())


def _collect(gm) -> list[list]:
    import torch
    from torch.utils._pytree import tree_leaves
    from autosplit.cost_model.kernels import gemm_shape
    from autosplit.cost_model.measured import op_class
    from autosplit.cost_model.roofline import output_dtype
    out = []
    for n in gm.graph.nodes:
        cost = n.meta.get("cost")
        if cost is None or not any(isinstance(v, torch.Tensor) for v in tree_leaves(n.meta.get("val"))):
            continue
        cls = op_class(n, cost)
        if cls == "view":
            continue
        out.append([cls, str(output_dtype(n)).removeprefix("torch."), cost.fwd_flops, cost.bwd_flops,
                    cost.fwd_bytes, cost.bwd_bytes, list(gemm_shape(n) or ())])
    return out


def features(key: tuple[str, int, bool]) -> dict:
    """Records at batch 1 and 2 (see *record*) of one (model, image size, fused) program, or why not."""
    model, img, fused = key
    try:
        one, two, params, tensors = _programs(model, img, fused)
    except Exception as e:                       # a model this timm cannot build or we cannot trace
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    if len(one) != len(two):
        return {"error": f"graphs differ between batch 1 and 2 ({len(one)} vs {len(two)} ops)"}
    return {"one": one, "two": two, "param_bytes": params, "param_tensors": tensors}


def at_batch(feat: dict, batch: int) -> list[list]:
    """The records of ``feat`` extrapolated to ``batch`` (see *record*)."""
    recs = []
    for a, b in zip(feat["one"], feat["two"]):
        nums = [x + (y - x) * (batch - 1) for x, y in zip(a[2:6], b[2:6])]
        shape = [x + (y - x) * (batch - 1) for x, y in zip(a[6], b[6])]
        recs.append([a[0], a[1], *nums, shape])
    return recs


def cache_path() -> Path:
    return Path(os.environ.get("AUTOSPLIT_BENCH_CACHE",
                               Path.home() / ".cache" / "autosplit" / "gpu_table_features.json"))


def _cache_name(key) -> str:
    model, img, fused = key
    return f"{model}|{img}|{int(fused)}"


def _read_cache() -> dict:
    path = cache_path()
    return json.loads(path.read_text()) if path.exists() else {}


def _write_cache(cache: dict) -> None:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cache))


def all_features(keys, workers: int = 2, progress: bool = True) -> dict:
    """features() of every key, from the cache where present; new ones computed in ``workers`` processes
    and added to the cache (written every 20 programs, so an interrupted run keeps what it traced)."""
    cache = _read_cache()
    todo = [k for k in keys if _cache_name(k) not in cache]
    if todo:
        import multiprocessing as mp
        from tqdm import tqdm
        with mp.get_context("spawn").Pool(workers) as pool:
            for k, f in zip(todo, tqdm(pool.imap(features, todo), total=len(todo), disable=not progress,
                                       desc="tracing table models")):
                cache[_cache_name(k)] = f
                if len(cache) % 20 == 0:
                    _write_cache(cache)
        _write_cache(cache)
    return {k: cache[_cache_name(k)] for k in keys}


def cached_features(keys) -> dict:
    """features() of the keys already in the cache (nothing traced)."""
    cache = _read_cache()
    return {k: cache[_cache_name(k)] for k in keys if _cache_name(k) in cache}
