"""One training step under torch.profiler on every rank, merged into one Chrome trace (``pm.trace_step``).

Terms:
  range     -- a ``torch.profiler.record_function`` span the runtime opens: ``autosplit::1F3`` (a compute
               action), ``autosplit::[1SEND_B0 1RECV_F2]`` (posting a transfer group; the same name a second
               time is the end-of-step wait for its sends), ``autosplit::wait 1RECV_F2`` (a compute waiting
               for its input), ``autosplit::all_reduce over tp`` (a tensor-parallel collective),
               ``autosplit::dp all_reduce`` / ``autosplit::loss all_reduce`` (step-level collectives).
  lanes     -- per rank (one Chrome ``pid`` per rank) three threads: ``compute`` (F / B / I / W; they never
               overlap), ``communication`` (groups, waits, collectives: each nested in a compute or between
               two) and ``step`` (the whole ``pm.step``).
  alignment -- every rank leaves the same barrier right before its step; a barrier ends on all ranks at
               (nearly) the same instant, when the last rank arrives, so each rank's times are shifted to
               make its barrier's end t = 0.  This needs no shared clock (ranks on several machines).
  net time  -- an action's span minus the communication ranges nested in it (receive waits, tp
               collectives): what the cost model calls its compute time.
Gathering is NCCL-safe: no collective but the barrier (on the CPU control group under NCCL); each rank
puts its events into the job's store and reads every other rank's back, each wait bounded by the
Watchdog, so every rank returns the same report, and rank 0 writes the file.
"""
from __future__ import annotations

import json
import logging
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from autosplit.cost_model.step_time import predict_plan

log = logging.getLogger("autosplit")
PREFIX = "autosplit::"
_COMPUTE = re.compile(r"^(\d+)([FBIW])(\d+)$")
_LANES = {"compute": 0, "communication": 1, "step": 2}
_CALLS = [0]


@dataclass
class StepTrace:
    """What ``trace_step`` measured: the Chrome-trace events, and measured vs predicted times (s)."""
    path: Path | None
    loss: float
    events: list[dict] = field(repr=False)
    step_time: float                    # slowest rank, barrier end to its step's end
    predicted_step: float
    stages: list[dict]                  # per stage: measured / predicted fwd, bwd, comm per microbatch
    kinds: dict[str, tuple[float, float]]   # action kind -> (measured, predicted) mean net seconds

    def table(self) -> str:
        """Measured vs predicted, per stage (ms per microbatch), per action kind and for the step."""
        rows = [("stage", "fwd ms meas/pred", "bwd ms meas/pred", "comm ms meas/pred")]
        for s in self.stages:
            rows.append((str(s["stage"]), *(f"{s[k] * 1e3:.3f} / {s[k + '_pred'] * 1e3:.3f}"
                                             for k in ("fwd", "bwd", "comm"))))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        kinds = ", ".join(f"{k} {m * 1e3:.3f}/{p * 1e3:.3f}" for k, (m, p) in sorted(self.kinds.items()))
        lines.append(f"per action kind, mean ms measured/predicted: {kinds}")
        ratio = self.step_time / self.predicted_step if self.predicted_step else float("nan")
        lines.append(f"step: measured {self.step_time * 1e3:.2f} ms, predicted {self.predicted_step * 1e3:.2f} ms "
                     f"(measured / predicted {ratio:.2f})")
        return "\n".join(lines)


def trace_step(pm, images, labels, path) -> StepTrace:
    """Run one training step (``pm.step``) under torch.profiler on every rank and write the merged trace.

    Args:
        pm: the ParallelModule (every rank calls this together, as it calls ``step``).
        images: this replica's batch, as for ``pm.step``.
        labels: its labels.
        path: where rank 0 writes the Chrome-trace JSON (opens in Perfetto / chrome://tracing); None
            writes nothing (the report is still returned).
    Returns the same ``StepTrace`` on every rank; rank 0 also logs its table beside ``plan.summary()``.
    """
    world, watchdog = pm.world, pm.watchdog
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if world.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        with record_function(f"{PREFIX}barrier"):
            _barrier(world, watchdog)
        with record_function(f"{PREFIX}step"):
            loss = pm.step(images, labels)
            if world.device.type == "cuda":
                torch.cuda.synchronize(world.device)
    mine = _own_events(prof)
    ranks = _exchange(world, watchdog, mine)
    events = _chrome_events(ranks, world)
    report = _report(pm.plan, pm.profile or pm.options.device, events, loss, path)
    if world.rank == 0:
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        log.info("traced step:\n%s\n%s", pm.plan.summary(), report.table())
    return report


def _barrier(world, watchdog) -> None:
    # under NCCL the barrier runs on the CPU control group, so it is a host-side rendezvous
    group = world.control_group
    work = dist.barrier(group=group, async_op=True)
    watchdog.wait(work, "trace_step barrier", host=True, on_host=group is not None)


def _own_events(prof) -> list[tuple[str, float, float]]:
    """(name without the prefix, start us, end us) of this rank's autosplit ranges, in start order."""
    out = []
    for e in prof.events():
        if e.name.startswith(PREFIX) and e.device_type.name == "CPU":
            out.append((e.name[len(PREFIX):], float(e.time_range.start), float(e.time_range.end)))
    return sorted(out, key=lambda x: (x[1], -x[2]))


def _exchange(world, watchdog, mine: list) -> list[list]:
    """Every rank's events, in rank order, through the store (see the module docstring)."""
    _CALLS[0] += 1
    key = f"autosplit/trace/{_CALLS[0]}/"
    world.store.set(f"{key}{world.rank}", json.dumps(mine))
    keys = [f"{key}{r}" for r in range(world.size)]
    watchdog.until(lambda: world.store.check(keys), "trace_step: waiting for every rank's events")
    return [json.loads(world.store.get(k)) for k in keys]


def _lane(name: str) -> str:
    return "compute" if _COMPUTE.match(name) else "step" if name == "step" else "communication"


def _chrome_events(ranks: list[list], world) -> list[dict]:
    """Chrome 'X' events, one pid per rank, ts in us from the barrier's end (see *alignment*)."""
    out = []
    for rank, events in enumerate(ranks):
        c = world.mesh.coord_of(rank)
        zero = next(end for name, _, end in events if name == "barrier")
        out.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "ts": 0,
                    "args": {"name": f"rank {rank} (pp={c.pp}, tp={c.tp}, dp={c.dp})"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "ts": 0,
                    "args": {"sort_index": rank}})
        for lane, tid in _LANES.items():
            out.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "ts": 0, "args": {"name": lane}})
        posted = set()
        for name, start, end in events:
            if name == "barrier":
                continue
            label = name
            if name.startswith("["):           # a group's second range is the end-of-step wait for its sends
                label = name if name not in posted else f"wait sends {name}"
                posted.add(name)
            lane = _lane(name)
            out.append({"name": label, "cat": lane, "ph": "X", "pid": rank, "tid": _LANES[lane],
                        "ts": round(start - zero, 3), "dur": round(end - start, 3)})
    return out


def _report(plan, profile, events: list[dict], loss: float, path) -> StepTrace:
    """Measured vs predicted: net compute per (stage, kind), nested communication per stage, the step."""
    net: dict[tuple[int, str], list[float]] = {}
    comm: dict[int, list[float]] = {}
    by_rank: dict[int, list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            by_rank.setdefault(e["pid"], []).append(e)
    for evs in by_rank.values():
        nested = [e for e in evs if e["cat"] == "communication"]
        for e in evs:
            m = _COMPUTE.match(e["name"])
            if not m:
                continue
            inside = sum(n["dur"] for n in nested if e["ts"] <= n["ts"] and n["ts"] + n["dur"] <= e["ts"] + e["dur"])
            stage = int(m.group(1))
            net.setdefault((stage, m.group(2)), []).append((e["dur"] - inside) * 1e-6)
            comm.setdefault(stage, []).append(inside * 1e-6)
    mean = lambda xs: statistics.fmean(xs) if xs else 0.0     # noqa: E731
    stages, kinds_meas, kinds_pred = [], {}, {}
    m = plan.num_microbatches
    for s in plan.stages:
        f = mean(net.get((s.index, "F"), []))
        b = mean(net.get((s.index, "B"), [])) or mean(net.get((s.index, "I"), [])) + mean(net.get((s.index, "W"), []))
        # per microbatch, the waits and collectives nested in the stage's actions, averaged over the
        # ranks that run the stage (its tp and dp ranks: each runs its m forwards)
        n_ranks = max(1, len(net.get((s.index, "F"), [])) // m)
        c = sum(comm.get(s.index, [])) / n_ranks / m
        stages.append({"stage": s.index, "fwd": f, "bwd": b, "comm": c,
                       "fwd_pred": s.fwd_time, "bwd_pred": s.bwd_time, "comm_pred": s.comm_time})
        preds = {"F": s.fwd_time, "B": s.bwd_time, "I": s.bwd_time - s.w_time, "W": s.w_time}
        for kind, pred in preds.items():
            if (s.index, kind) in net:
                kinds_meas.setdefault(kind, []).extend(net[(s.index, kind)])
                kinds_pred.setdefault(kind, []).extend([pred] * len(net[(s.index, kind)]))
    kinds = {k: (mean(kinds_meas[k]), mean(kinds_pred[k])) for k in kinds_meas}
    step = max(e["ts"] + e["dur"] for e in events if e.get("name") == "step") * 1e-6
    return StepTrace(path=Path(path) if path is not None else None, loss=loss, events=events, step_time=step,
                     predicted_step=predict_plan(plan, device=profile).total, stages=stages, kinds=kinds)
