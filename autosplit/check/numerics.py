"""The numerics part: every configuration the world allows trains the tiny ViT as plain PyTorch does.

Terms: see autosplit/check/__init__.py (configuration, reference, action, mutation) and configs.py.
  steps      -- ``steps`` SGD steps (lr ``lr``) on the global batches of tiny_vit.py, each replica taking
                its rows ``[k*B/dp, (k+1)*B/dp)`` (the contract's split), the loss mean-reduced.
  compared   -- each step's loss (the float ``pm.step`` returns) and, after the last step, every entry of
                ``pm.full_state_dict()`` against the reference's, as max absolute differences; both must
                be within ``tolerance`` (fp32: 1e-5 on CPU; 1e-4 on CUDA, where the sharded GEMMs take
                other cuBLAS kernels, TF32 kept off on both sides).
  profile    -- every configuration plans with the built-in "h100" profile: the cost model only picks
                the cut and the layouts here, and a fixed profile keeps the part from measuring this
                machine first (which the profile part does).
  origin     -- of the ranks that failed, the one whose error was its own, not the ``RankFailure`` the
                runtime raises on every other rank once one fails: the rank a failure line names.
"""
from __future__ import annotations

import contextlib
import copy
import time
import traceback

import torch

from autosplit.check.configs import Config, global_batch, select
from autosplit.check.job import one_line, release_open_modules
from autosplit.check.mutate import ENV, mutated_config, mutation
from autosplit.check.record import make_record
from autosplit.check.tiny_vit import batches, tiny_vit

DEFAULT_TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}


@contextlib.contextmanager
def _exact_fp32():
    """TF32 off for both the reference and the configurations (so fp32 means fp32 on CUDA)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def reference(model: torch.nn.Module, xs, ys, lr: float, device) -> tuple[list[float], dict]:
    """Plain PyTorch on ``device``: (each step's loss, the state dict after the last step, on the CPU)."""
    model = copy.deepcopy(model).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys):
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def inductor_problem(cw) -> str | None:
    """Why torch.compile's inductor does not work on this rank's device (any rank's reason), or None."""
    try:
        out = torch.compile(lambda x: torch.sin(x) * 2 + 1)(torch.ones(4, device=cw.device))
        problem = None if torch.allclose(out.cpu(), torch.sin(torch.ones(4)) * 2 + 1) else "a wrong result"
    except Exception as exc:       # a missing compiler, triton, a backend torch refuses: each its own type
        problem = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    problems = [p for p in cw.gather(problem) if p]
    return problems[0] if problems else None


def _compare(losses, state, ref_losses, ref_state, tolerance: float) -> tuple[float, float, str, str | None]:
    """(loss diff, param diff, the worst parameter, the failed comparison or None)."""
    loss_diffs = [abs(a - b) for a, b in zip(losses, ref_losses)]
    worst, param_diff = "", 0.0
    for k, v in ref_state.items():
        d = (state[k].detach().float().cpu() - v.float()).abs().max().item()
        if d > param_diff or not worst:
            worst, param_diff = k, d
    failure = None
    bad = [i for i, d in enumerate(loss_diffs) if not d <= tolerance]     # (not <=: NaN fails)
    if bad:
        i = bad[0]
        failure = (f"loss of step {i + 1}: {losses[i]:.7g} vs reference {ref_losses[i]:.7g} "
                   f"(diff {loss_diffs[i]:.2e} > {tolerance:.0e})")
    elif not param_diff <= tolerance:
        failure = (f"parameters after {len(losses)} steps: {worst} differs by {param_diff:.2e} "
                   f"(> {tolerance:.0e})")
    return max(loss_diffs, default=0.0), param_diff, worst, failure


def run_config(config: Config, cw, model, xs, ys, ref, tolerance: float, lr: float, mutate: bool) -> dict:
    """Train one configuration on this rank and compare it with the reference: this rank's result."""
    import autosplit
    from autosplit.runtime.faults.deadlines import RankFailure
    mesh = config.mesh(cw.size)
    dp, m = mesh[2], config.options["num_microbatches"]
    rows = xs.shape[1] // dp
    action, start = "parallelize", time.perf_counter()
    out = {"rank": cw.rank, "ok": False, "failure": None, "secondary": False, "perturbed": 0}
    counter = [0]
    try:
        pm = autosplit.parallelize(copy.deepcopy(model), mesh=mesh, loss_fn=torch.nn.CrossEntropyLoss(),
                                   example_input=xs[0, : rows // m], device="h100", **config.options)
        opt = torch.optim.SGD(pm.parameters(), lr=lr)
        sl = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
        losses = []
        with mutation(mutate, cw.rank, cw.size) as counter:
            for k, (x, y) in enumerate(zip(xs, ys)):
                action = f"step {k + 1}"
                losses.append(pm.step(x[sl], y[sl]))
                opt.step()
                opt.zero_grad()
        action = "full_state_dict"
        state = pm.full_state_dict()
        action = "close"
        pm.close()
        loss_diff, param_diff, worst, failure = _compare(losses, state, *ref, tolerance)
        out.update(ok=failure is None, loss_diff=loss_diff, param_diff=param_diff, worst_param=worst,
                   failure=failure)
    except Exception as exc:
        out.update(failure=f"{action}: {one_line(exc)}", secondary=isinstance(exc, RankFailure),
                   traceback=traceback.format_exc(limit=-6))
        release_open_modules()
    out.update(seconds=time.perf_counter() - start, perturbed=counter[0])
    return out


def _verdict(config: Config, mesh, results: list[dict]) -> dict:
    """One configuration's record from every rank's result (see *origin*)."""
    failed = [r for r in results if not r["ok"]]
    origin = next((r for r in failed if not r["secondary"]), failed[0]) if failed else None
    entry = {"name": config.name, "mesh": list(mesh), "options": {k: str(v) for k, v in config.options.items()},
             "passed": not failed, "seconds": max(r["seconds"] for r in results),
             "loss_diff": max((r.get("loss_diff", float("nan")) for r in results), default=float("nan")),
             "param_diff": max((r.get("param_diff", float("nan")) for r in results), default=float("nan")),
             "perturbed": sum(r["perturbed"] for r in results), "ranks": results}
    if origin is not None:
        entry.update(rank=origin["rank"], failure=origin["failure"],
                     failed_ranks=[r["rank"] for r in failed])
    return entry


def _row(e: dict) -> str:
    mesh = "(" + ",".join(map(str, e["mesh"])) + ")"
    head = f"  {'PASS' if e['passed'] else 'FAIL'} {e['name']:<20} mesh {mesh:<9}"
    if e["passed"]:
        return f"{head} loss diff {e['loss_diff']:.1e}  param diff {e['param_diff']:.1e}  {e['seconds']:.1f} s"
    return f"{head} rank {e['rank']}, {e['failure']}  {e['seconds']:.1f} s"


def run_numerics(cw, quick: bool = False, names: list[str] | None = None, steps: int = 3, lr: float = 0.1,
                 tolerance: float | None = None, mutate: str | None = None) -> dict:
    """Run the configurations on every rank of ``cw`` (a CheckWorld); rank 0 prints a line per
    configuration and the part's verdict.  Returns the part's record (the same on every rank).

    Args:
        cw: the check's world (job.py).
        quick: only the quick configurations (configs.py).
        names: exactly these configurations instead.
        steps, lr: SGD steps and learning rate (see *steps*).
        tolerance: max absolute loss and parameter difference; None: ``DEFAULT_TOLERANCE`` of the device.
        mutate: the configuration whose collectives to break (mutate.py); None: the environment's.
    """
    start = time.perf_counter()
    tolerance = tolerance if tolerance is not None else DEFAULT_TOLERANCE.get(cw.device.type, 1e-4)
    mutate = mutate if mutate is not None else mutated_config()
    wanted, _ = select(cw.size, quick, names)
    problem = inductor_problem(cw) if any(c.compiled for c in wanted) else None
    configs, skipped = select(cw.size, quick, names, problem)
    cw.say(f"numerics: {len(configs)} configuration{'s' if len(configs) != 1 else ''} of the tiny ViT on "
           f"{cw.size} rank{'s' if cw.size > 1 else ''} ({cw.backend}, {cw.device.type}), {steps} SGD steps each "
           f"against plain PyTorch on every rank, tolerance {tolerance:.0e}")
    torch.manual_seed(0)
    model = tiny_vit()
    xs, ys = batches(steps, global_batch(cw.size))
    entries = []
    with _exact_fp32():
        t0 = time.perf_counter()
        ref = reference(model, xs, ys, lr, cw.device)
        cw.say(f"  reference (plain PyTorch, batch {xs.shape[1]}): losses "
               f"{', '.join(f'{v:.5f}' for v in ref[0])}  {time.perf_counter() - t0:.1f} s")
        for config in configs:
            mine = run_config(config, cw, model, xs, ys, ref, tolerance, lr, mutate == config.name)
            entries.append(_verdict(config, config.mesh(cw.size), cw.gather(mine)))
            cw.say(_row(entries[-1]))
            if mutate == config.name and entries[-1]["perturbed"] == 0:
                cw.say(f"  note: {ENV}={config.name}, but it called no collective the mutation shifts")
    for c, why in skipped:
        cw.say(f"  skip {c.name:<20} {why}")
    failed = [e for e in entries if not e["passed"]]
    seconds = time.perf_counter() - start
    if failed:
        first = failed[0]
        text = (f"{first['name']} (rank {first['rank']}, {first['failure']}); "
                f"{len(entries) - len(failed)} of {len(entries)} configurations passed"
                + (f"; also failed: {', '.join(e['name'] for e in failed[1:])}" if len(failed) > 1 else ""))
    elif not entries:
        text = "no configuration ran: " + "; ".join(f"{c.name}: {why}" for c, why in skipped)
    else:
        text = (f"{len(entries)} configuration{'s' if len(entries) > 1 else ''} equal plain PyTorch within "
                f"{tolerance:.0e} ({seconds:.1f} s; {len(skipped)} skipped)")
    record = make_record("numerics", bool(entries) and not failed, text, tolerance=tolerance, steps=steps, lr=lr,
                         seconds=seconds, reference_losses=ref[0], configurations=entries,
                         skipped={c.name: why for c, why in skipped}, mutated=mutate)
    cw.say(record["line"])
    return record

