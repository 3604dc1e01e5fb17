"""Measure the compute fits of a profile: each op class timed as the runtime runs it, in one process.

Terms (op class, work, fit: see measured.py):
  chain   -- a small traced GraphModule of k ops of one class, run forward with inputs that need
             gradients and then backward, the way a stage GraphModule runs; its time over its k ops
             amortizes the fixed cost of starting a backward, and its work is the sum of what the cost
             rules (flops.py) say its nodes do, so the fit prices exactly the quantities plans use.
  sizes   -- shapes around what a small ViT's microbatches give (tokens x width 192, 4 x width, heads
             of 64, tensor-parallel halves), from tiny to a few hundred MFLOP per op: small GEMMs are
             slower per FLOP and the fit's alpha captures that.
  budget  -- seconds of timed repeats per chain (after one warm-up); their mean counts (see _samples).
The thread count is whatever torch uses already; we never change it.  No process is spawned.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from autosplit.cost_model.annotate import AnnotateCosts
from autosplit.cost_model.measured import OP_CLASSES, fit_alpha_rate, op_class, work


class _Chain(nn.Module):
    """k ops of one kind applied in turn: ``step(self, i, x, y) -> x``."""

    def __init__(self, kind: str, k: int, shape: tuple):
        super().__init__()
        self.kind, self.k = kind, k
        if kind == "linear":
            m, c_in, c_out = shape
            self.layers = nn.ModuleList(nn.Linear(c_in, c_out) if i % 2 == 0 else nn.Linear(c_out, c_in)
                                        for i in range(k))
        elif kind == "layer_norm":
            self.layers = nn.ModuleList(nn.LayerNorm(shape[-1]) for _ in range(k))

    def forward(self, x, y):
        for i in range(self.k):
            if self.kind in ("linear", "layer_norm"):
                x = self.layers[i](x)
            elif self.kind == "sdpa":
                x = F.scaled_dot_product_attention(x, y, y)
            elif self.kind == "softmax":
                x = torch.softmax(x, dim=-1)
            elif self.kind == "pointwise":
                x = F.gelu(x) if i % 2 else x + y
            elif self.kind == "view":
                x = x.transpose(-1, -2)
        return x


# (chain kind, ops per chain, input shape, second input shape) -- see *sizes*
_CASES = [
    *[("linear", 2, (m, k, n), (m, k), (1,)) for m, k, n in
      ((64, 32, 64), (130, 192, 192), (260, 96, 384), (520, 192, 768), (1040, 192, 576), (2080, 192, 768))],
    *[("sdpa", 2, None, s, s) for s in ((4, 2, 17, 16), (2, 3, 65, 64), (8, 3, 65, 64), (8, 6, 65, 32),
                                         (32, 3, 65, 64))],
    *[("layer_norm", 4, (s[-1],), s, (1,)) for s in ((8, 17, 32), (2, 65, 192), (8, 65, 192), (32, 65, 192))],
    *[("softmax", 4, None, s, (1,)) for s in ((2, 2, 17, 17), (8, 3, 65, 65), (32, 3, 65, 65))],
    *[("pointwise", 4, None, s, s) for s in ((8, 17, 32), (2, 65, 192), (8, 65, 768), (32, 65, 768))],
    *[("view", 8, None, (8, 65, 192), (8, 65, 192)), ("view", 8, None, (2, 17, 32), (2, 17, 32))],
]


def traced(model: nn.Module, inputs: tuple, leaf_modules=(), concrete_args=None, autocast=None,
           device_type: str = "cpu"):
    """``model`` traced and priced as a plan's stage would be: a GraphModule whose nodes carry ``val`` and
    ``cost`` for ``inputs`` (here the chains; model_fit.py the user's model), with the dtypes
    ``torch.autocast(device_type, autocast)`` gives where ``autocast`` is a half dtype, as compile does."""
    from autosplit.passes.shape_prop import MetaShapeProp      # graph passes: the level above flops.py
    from autosplit.trace import trace
    gm = trace(model, len(inputs), leaf_modules=leaf_modules, concrete_args=concrete_args)
    MetaShapeProp(inputs)(gm)
    if autocast is not None:
        from autosplit.passes.autocast_prop import AutocastDtypeProp
        AutocastDtypeProp(inputs, autocast, device_type)(gm)
    AnnotateCosts()(gm)
    return gm


def _samples(kind: str, k: int, shape, x_shape, y_shape, budget: float, device) -> dict:
    """{op class: [(ops, fwd work, fwd s, bwd work, bwd s)]} of one chain."""
    # drawn on the CPU from a seeded private stream: the caller's random streams are left as they were
    # (calibrate() may run between a user's seeding and their model's creation)
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(0)
        model = _Chain(kind, k, shape).to(device)
        x = torch.randn(*x_shape).to(device).requires_grad_()
        y = torch.randn(*y_shape).to(device).requires_grad_(kind in ("sdpa", "pointwise"))
    gm = traced(model, (x, y))
    per_class: dict[str, list] = {}
    for n in gm.graph.nodes:
        cost = n.meta.get("cost")
        if n.op in ("call_function", "call_method", "call_module") and cost is not None \
                and isinstance(n.meta.get("val"), torch.Tensor):
            cls = op_class(n, cost)
            f, b = work(cost, cls)
            ops, fw, bw = per_class.get(cls, (0, 0.0, 0.0))
            per_class[cls] = (ops + 1, fw + f, bw + b)
    main = max(per_class, key=lambda c: per_class[c][0] if c != "view" or kind == "view" else -1)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    grad = torch.ones_like(gm(x, y))

    def step() -> tuple[float, float]:    # (forward s, backward s) of one forward + backward
        t0 = time.perf_counter()
        out = gm(x, y)
        sync()
        t1 = time.perf_counter()
        out.backward(grad)
        sync()
        return t1 - t0, time.perf_counter() - t1

    step()                                # warm-up
    times, start = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget and len(times) < 50):
        times.append(step())
    ops, fw, bw = per_class[main]
    # the mean, not the median: ranks sharing cores are time-sliced, and only the mean over the window
    # sees the share of a core each gets (a median picks the slices that ran alone)
    return {main: [(ops, fw, statistics.fmean(t[0] for t in times), bw, statistics.fmean(t[1] for t in times))]}


def measure_compute(budget: float = 2.0, device="cpu") -> dict:
    """op class -> (forward fit, backward fit), each (alpha s, rate per s), measured here in float32.

    Args:
        budget: seconds of timed repeats over all chains (warm-ups and tracing come on top, about as much).
        device: where the ops run ("cpu", or a CUDA device).
    """
    samples: dict[str, list] = {c: [] for c in OP_CLASSES}
    share = budget / len(_CASES)
    for kind, k, shape, x_shape, y_shape in _CASES:
        for cls, rows in _samples(kind, k, shape, x_shape, y_shape, share, device).items():
            samples[cls].extend(rows)
    return {cls: (fit_alpha_rate([(o, fw, ft) for o, fw, ft, _, _ in rows]),
                  fit_alpha_rate([(o, bw, bt) for o, _, _, bw, bt in rows]))
            for cls, rows in samples.items() if rows}
