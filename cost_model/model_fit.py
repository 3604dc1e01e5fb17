"""Fit a measured profile to the model at hand: time the model's own forward and backward at two
microbatch sizes and rescale the op-class fits so that the cost model's sums match both.

Terms:
  parts   -- a pass's predicted time over the traced graph (the nodes ``graph_time`` prices), split in
             two sums: the ops' constants (each op's class alpha) and their work terms (work / rate);
             measured.py's ``measured_op_parts``.
  scales  -- per pass (forward, backward) the pair (k_alpha, k_work) with
             k_alpha * constants(b) + k_work * work(b) = measured(b) at both sizes; every class's fit
             (alpha, rate) becomes (alpha * k_alpha, rate / k_work).  Where the two equations give a
             factor <= 0 (sizes whose parts are nearly proportional, or noise), one factor
             sum(measured) / sum(predicted) scales both.
  why     -- the op benchmarks (op_bench.py) time short chains of one op kind on small weights; inside a
             model the same ops run slower or faster (other layers' weights in the caches, a larger
             autograd graph, GEMM shapes the chains do not have).  On the CPU benchmark ViT the chains'
             fits priced the forward's per-op constants at about a third of what they are.  Galvatron
             profiles a model's layers on the device for the same reason; two whole passes suffice
             here because the class fits already give each op's share.
  measured -- the median of at least ``reps`` timed passes (after one warm-up) of the traced model,
             forward then backward of the sum of its outputs, the two sizes taking turns, on a private
             copy (the user's model and its gradients are not touched; a meta model's copy gets small
             random values), under autosplit/host_memory.py's malloc settings and with the gradients
             accumulating from pass to pass, as training runs.
  fits    -- a profile with measured compute fits (a CPU profile from profiling/measure_profile.py) has
             each class's fit rescaled, forward and backward apart.  A roofline profile (a datasheet GPU,
             ``calibrate()``'s peaks) has one pair for the whole pass: ``op_overhead * k_alpha`` and
             every peak FLOP/s and the memory bandwidth divided by ``k_work`` (a roofline op's time is
             the max of its FLOP and byte terms, so one factor on both scales it exactly); on a datasheet
             H100 the roofline priced ViT-B/16's step at 0.36-0.59 of what it took.
  device  -- where the passes run: the profile's device type (``DeviceProfile.device_type``); a GPU
             profile where no GPU is present comes back as it is.  ``autocast``: the passes run under
             ``torch.autocast`` and are priced with its dtypes (compile's AutocastDtypeProp), as a plan
             with that option is.
Single process, no process group: call it once and pass the result to every rank (``device=``), as a
measured profile is; ranks fitting on their own would plan with different numbers.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from autosplit.cost_model.measured import measured_op_parts, op_class
from autosplit.cost_model.kernels import gemm_shape
from autosplit.cost_model.roofline import output_dtype, roofline_op_parts
from autosplit.errors import AutosplitError


@dataclasses.dataclass(frozen=True)
class ModelFit:
    """What ``fit_to_model`` measured and solved: per size, (measured, predicted) seconds per pass."""
    sizes: tuple[int, int]
    measured: dict            # "fwd" / "bwd" -> (seconds at sizes[0], seconds at sizes[1])
    predicted: dict           # same, with the profile before the fit
    scales: dict              # "fwd" / "bwd" -> (k_alpha, k_work)

    def line(self) -> str:
        parts = [f"{p} x{ka:.2f} alpha x{kw:.2f} work" for p, (ka, kw) in self.scales.items()]
        return f"fitted to the model at microbatch {self.sizes[0]} and {self.sizes[1]}: " + ", ".join(parts)


def _fill(name: str, t: torch.Tensor) -> None:
    t.normal_(0, 0.02) if t.is_floating_point() else t.zero_()


def _private_copy(model: nn.Module) -> nn.Module:
    """A CPU copy with real tensors: the model's own values, small random ones for meta tensors (the time
    of a pass does not depend on them); fit_to_model traces it on the CPU and moves it after."""
    copied = copy.deepcopy(model)
    if any(t.device.type == "meta" for t in (*copied.parameters(), *copied.buffers())):
        from autosplit.meta_init import materialize            # the level above: its names and placement
        materialize(copied, init_fn=_fill)
    return copied.train()


def _inputs(example: tuple[torch.Tensor, ...], b: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(b, *x.shape[1:], generator=g).to(x.dtype) if x.is_floating_point()
                 else torch.zeros(b, *x.shape[1:], dtype=x.dtype) for x in example)


def _predicted_parts(gm, profile) -> dict:
    """"fwd" / "bwd" -> (constants s, work s) over the nodes ``graph_time`` prices."""
    sums = {"fwd": [0.0, 0.0], "bwd": [0.0, 0.0]}
    for n in gm.graph.nodes:
        cost = n.meta.get("cost")
        if cost is None or not any(isinstance(x, torch.Tensor) for x in tree_leaves(n.meta.get("val"))):
            continue
        cls = op_class(n, cost)
        if profile.compute is not None and cls in profile.compute:
            fwd, bwd = measured_op_parts(cost, cls, output_dtype(n), profile)
        else:
            fwd, bwd = roofline_op_parts(cost, output_dtype(n), profile, cls, gemm_shape(n))
        for key, (alpha, work) in (("fwd", fwd), ("bwd", bwd)):
            sums[key][0] += alpha
            sums[key][1] += work
    return {k: tuple(v) for k, v in sums.items()}


def _pass_times(gm, inputs, device: torch.device, autocast) -> tuple[float, float]:
    """(forward s, backward s) of one pass of the traced model on ``inputs``; on a GPU each part ends with
    a synchronize, so the time is the kernels', not their launches'."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
        out = gm(*inputs)
    sync()
    t1 = time.perf_counter()
    sum(x.float().sum() for x in tree_leaves(out) if isinstance(x, torch.Tensor) and x.requires_grad).backward()
    sync()
    t2 = time.perf_counter()
    # no zero_grad between passes: the gradients accumulate, as they do over a step's microbatches
    # (adding into .grad cost 0.5-1 ms more per pass of the depth-6 CPU ViT than writing a fresh one)
    return t1 - t0, t2 - t1


def _measured(runs: list, reps: int, budget: float, device: torch.device, autocast) -> list[tuple[float, float]]:
    """Per (gm, inputs) of ``runs``, the median (forward s, backward s) of its passes.  The sizes take turns
    (one pass each per round), so that both see the same drift of a shared machine: the fit rests on
    their difference, which a slow minute for one size alone would bend."""
    for gm, inputs in runs:
        _pass_times(gm, inputs, device, autocast)          # warm-up
    times: list[list] = [[] for _ in runs]
    start = time.perf_counter()
    while len(times[0]) < reps or (time.perf_counter() - start < budget and len(times[0]) < 8 * reps):
        for k, (gm, inputs) in enumerate(runs):
            times[k].append(_pass_times(gm, inputs, device, autocast))
    return [(statistics.median(t for t, _ in ts), statistics.median(t for _, t in ts)) for ts in times]


def _solve(pred: tuple, meas: tuple) -> tuple[float, float]:
    """(k_alpha, k_work) with k_alpha * a_i + k_work * w_i = t_i for both sizes (see *scales*)."""
    (a1, w1), (a2, w2) = pred
    t1, t2 = meas
    det = a1 * w2 - a2 * w1
    if abs(det) > 1e-9 * (abs(a1 * w2) + abs(a2 * w1)):
        ka, kw = (t1 * w2 - t2 * w1) / det, (a1 * t2 - a2 * t1) / det
        if ka > 0 and kw > 0:
            return ka, kw
    k = (t1 + t2) / max(a1 + w1 + a2 + w2, 1e-12)
    return k, k


def fit_to_model(profile, model: nn.Module, example_input, *, sizes: tuple[int, int] = (2, 8), reps: int = 5,
                 budget: float = 4.0, leaf_modules=(), concrete_args=None, device=None,
                 autocast: torch.dtype | None = None):
    """``profile`` with its compute rescaled to ``model`` on this machine, and the ModelFit.

    Args:
        profile: a DeviceProfile (or a name): measured compute fits or a roofline (see *fits*).
        model: the unchanged model (on the CPU or the meta device; it is not modified).
        example_input: one example of the forward's input(s), batch dim first (only per-sample shape and
            dtype are used).
        sizes: the two microbatch sizes timed (small, large: the range the plans will use).
        reps, budget: at least ``reps`` timed passes per size, more (up to 8 x reps) while ``budget``
            seconds last.
        leaf_modules, concrete_args: as for ``autosplit.compile``.
        device: where to time the passes; None: the profile's device type (a GPU profile comes back
            unchanged, with None, where no GPU is present).  A device of another type than the profile's
            is refused: its times would say nothing of the profiled device.
        autocast: torch.bfloat16 / torch.float16 to fit for plans with that ``autocast`` option.
    Returns:
        (profile, ModelFit | None): None where nothing was fitted.
    """
    from autosplit.cost_model.op_bench import traced
    from autosplit.cost_model.profiles import get_profile
    profile = get_profile(profile)
    if device is None:
        if profile.device_type == "cuda" and not torch.cuda.is_available():
            return profile, None
        device = "cuda" if profile.device_type == "cuda" else "cpu"
    device = torch.device(device)
    if device.type != profile.device_type:
        raise AutosplitError(f"fit_to_model: profile {profile.name!r} is for a {profile.device_type} device, but "
                             f"device={str(device)!r} would time the model on {device.type}; pass a {device.type} "
                             f"profile or device={profile.device_type!r}")
    if device.type == "cpu":
        from autosplit.host_memory import keep_freed_host_memory
        keep_freed_host_memory()           # time the passes under the malloc settings training runs with
    example = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    real = _private_copy(model)
    pred, meas, runs = {"fwd": [], "bwd": []}, {"fwd": [], "bwd": []}, []
    with torch.random.fork_rng(devices=[]):
        for b in sizes:
            inputs = _inputs(example, b)
            gm = traced(real, inputs, leaf_modules, concrete_args, autocast, device.type)
            parts = _predicted_parts(gm, profile)
            runs.append((gm, inputs))
            for key in ("fwd", "bwd"):
                pred[key].append(parts[key])
        real.to(device)                    # both traced modules hold its submodules: moved once, here
        runs = [(gm.to(device), tuple(x.to(device) for x in inputs)) for gm, inputs in runs]
        for times in _measured(runs, reps, budget, device, autocast):
            for k, key in enumerate(("fwd", "bwd")):
                meas[key].append(times[k])
    if profile.compute is not None:
        scales = {key: _solve(tuple(pred[key]), tuple(meas[key])) for key in ("fwd", "bwd")}
        (fka, fkw), (bka, bkw) = scales["fwd"], scales["bwd"]
        compute = {cls: ((fa * fka, fr / fkw), (ba * bka, br / bkw))
                   for cls, ((fa, fr), (ba, br)) in profile.compute.items()}
        changes = dict(compute=compute)
    else:                                  # a roofline: one pair for the whole pass (see *fits*)
        total = tuple((pred["fwd"][i][0] + pred["bwd"][i][0], pred["fwd"][i][1] + pred["bwd"][i][1]) for i in range(2))
        ka, kw = _solve(total, tuple(meas["fwd"][i] + meas["bwd"][i] for i in range(2)))
        scales = {"pass": (ka, kw)}
        changes = dict(op_overhead=profile.op_overhead * ka, mem_bandwidth=profile.mem_bandwidth / kw,
                       peak_flops={dt: f / kw for dt, f in profile.peak_flops.items()})
    fit = ModelFit(tuple(sizes), {k: tuple(v) for k, v in meas.items()},
                   {k: tuple(a + w for a, w in v) for k, v in pred.items()}, scales)
    where = f" on {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""
    return dataclasses.replace(profile, name=f"{profile.name}, {fit.line()}{where}", **changes), fit
