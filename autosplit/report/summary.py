"""Readable views of a Plan: the summary table and the JSON-ready dict.

Terms: see autosplit/plan.py.  Times are the cost model's predictions per microbatch (ms), memory is the
predicted peak per stage (MiB/GiB), "boundary" lists the tensors a stage sends to the next.
"""
from __future__ import annotations

from dataclasses import asdict

from torch.distributed.tensor import Shard


from autosplit.cost_model.step_time import plan_deferred_w_stages, predict_plan
from autosplit.errors import AutosplitError
from autosplit.passes.sharding.describe import block_lines
from autosplit.schedule import SPLIT_BACKWARD
from autosplit.stage_info import StageInfo
from autosplit.tp.axes import batch_ways
from autosplit.trace_notes import trace_notes

# ``plan`` below: an autosplit Plan (autosplit/plan.py), read, never imported (the Plan imports this).


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def _boundary(stage) -> str:
    if not stage.outputs or stage.outputs[0].name == "output":
        return "(model output)"
    shapes = " ".join("x".join(map(str, t.shape)) + f" {t.dtype}" for t in stage.outputs)
    return f"{len(stage.outputs)} x [{shapes}] {_bytes(sum(t.nbytes for t in stage.outputs))}"


BASELINE = "torchtitan's cut (embedding and head count as layers)"


def _ratio(value) -> str:
    return "n/a" if value is None else f"{value:.3f}"     # None: the baseline has no cut


def summary_table(plan) -> str:
    header = ("stage", "rank", "layers", "params", "fwd ms", "bwd ms", "comm ms", "act/mb", "recompute", "memory",
              "boundary")
    rows = [header]
    for s in plan.stages:
        rows.append((str(s.index), f"pp{s.pp_rank}.c{s.chunk}", s.layers, _count(s.n_params),
                     f"{s.fwd_time * 1e3:.3f}", f"{s.bwd_time * 1e3:.3f}", f"{s.comm_time * 1e3:.3f}",
                     _bytes(s.activation_bytes), _bytes(s.recompute_bytes) if plan.recompute else "-",
                     _bytes(s.memory_bytes), _boundary(s)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    ours, equal = plan.balance()
    shapes = ", ".join("x".join(map(str, s)) for s in plan.example_shapes)
    head = (f"autosplit plan: mesh {plan.mesh}, {plan.n_stages} stages, schedule {plan.schedule}, "
            f"{plan.num_microbatches} microbatches of [{shapes}], device model {plan.device}, "
            f"autocast {plan.autocast or 'off (float32)'}, recompute {plan.recompute or 'off'}")
    foot = [f"balance (max/mean stage time): {ours:.3f} autosplit vs {_ratio(equal)} {BASELINE}", _step_line(plan)]
    if plan.recompute:
        what = "its inputs" if plan.recompute == "stage" else "the tensors entering each layer"
        foot.append(f"recompute={plan.recompute}: act/mb is what each in-flight microbatch keeps ({what}); "
                    f"recompute is held while one microbatch's forward is recomputed (bwd ms includes it)")
    if plan.schedule in SPLIT_BACKWARD:
        deferred = plan_deferred_w_stages(plan)
        fused = [k for k in range(plan.n_stages) if k not in deferred]
        foot.append(f"{plan.schedule}: backward split into I (input gradient) and W (weight gradients, deferred "
                    f"to fill the bubble); W ms per stage (part of bwd ms): "
                    + ", ".join(f"{s.w_time * 1e3:.3f}" for s in plan.stages)
                    + ("" if not fused else f"; stage{'s' if len(fused) > 1 else ''} "
                       f"{', '.join(map(str, fused))} kept fused (every W right after its I: I runs the whole "
                       f"backward; see schedule.deferring_stages)"))
    if plan.mesh.dp > 1:
        foot.append(_dp_note(plan))
    if plan.tp_plan is not None:
        tp = plan.tp_plan
        if plan.mesh.cp > 1:
            foot += _cp_note(plan)
            foot += [f"  {line}" for line in block_lines(tp.regions)]
        elif tp.axes:
            foot += _grid_note(plan)
            foot += [f"  {line}" for line in block_lines(tp.regions)]
        else:
            split = sum(1 for line in tp.regions if ": whole" not in line)
            mode = plan.tp_mode + (f" -> {tp.mode}" if tp.mode else "")
            foot.append(f"tensor parallel (tp={tp.tp}, {mode}{', sequence parallel' if tp.sequence_parallel else ''}): "
                        f"{split} of {len(tp.regions)} layers split, {len(tp.sharded)} parameters split "
                        f"(plan.explain(node) shows one op's candidates); per block:")
            foot += [f"  {line}" for line in block_lines(tp.regions)]
        foot += [f"  note: {note}" for note in tp.notes]
    foot += trace_notes(plan.graph)             # leaves kept whole and why; shape guards
    if plan.unknown_ops:
        foot.append(f"ops without a cost rule (counted as memory-bound): {', '.join(plan.unknown_ops)}")
    return "\n".join([head, *lines, *foot])


def _step_line(plan) -> str:
    """The timed schedule's step prediction (cost_model/step_time.py); a profile known only by an
    unregistered name cannot be priced again here: predict_plan(plan, device=profile) can."""
    try:
        return predict_plan(plan).line()
    except AutosplitError as exc:
        return f"predicted step: n/a ({exc.args[0].split(';')[0]}; use predict_plan(plan, device=profile))"


def _cp_note(plan) -> list[str]:
    """Context parallelism: the block's axes, what each rank holds, and how each attention gets its keys
    (passes/sharding/context.py *attention lowering*)."""
    tp = plan.tp_plan
    params = sum(s.param_bytes for s in plan.stages)
    acts = sum(s.activation_bytes for s in plan.stages)
    inner = f", 1D tensor parallelism over tp_1d ({plan.mesh.tp})" if plan.mesh.tp > 1 else ""
    why = "the cheaper by the cost model" if plan.cp_attention == "auto" else f"cp_attention={plan.cp_attention!r}"
    lines = [f"context parallel (cp={plan.mesh.cp}{inner}): the query tokens of every op split over cp, padded "
             f"where cp does not divide them; per rank: params {_bytes(params)}, saved activations {_bytes(acts)} "
             f"per microbatch; each attention's lowering ({why}):"]
    readers: dict = {}
    for n in plan.graph.graph.nodes:
        if n.meta.get("key_copy_of"):
            for u in n.users:
                readers.setdefault(u, []).append(n)
    for u, keys in readers.items():
        lines.append(f"  {u.meta.get('module_path') or u.name} ({u.name}): {_attention_lowering(keys)}")
    return lines


def _attention_lowering(keys) -> str:
    """How one attention gets its keys: the split its key copies carry over cp (context.py keys_split)."""
    how = {k.meta.get("cp_keys", "gather") for k in keys}
    if how <= {"gather"}:
        why = next((k.meta["cp_why"] for k in keys if k.meta.get("cp_why")), "")
        return (f"queries split, {' and '.join(k.meta['key_copy_of'] for k in keys)} all-gathered over cp "
                f"(gradients reduce-scattered){': ' + why if why else ''}")
    if "heads" in how:
        return "heads split: q, k, v all-to-all'd from tokens to heads and the output back (Ulysses)"
    shape, place = keys[0].meta["val"].shape, keys[0].meta.get("spec", {}).get("cp")
    at = f"dim {place.dim}" if isinstance(place, Shard) else "a dim"
    whose = "windows merged into the batch" if "tokens" in how else "the batch"
    return (f"whole sequences per rank: the keys' {at} ({whose}) split over cp, each rank attending over its "
            f"own sequences of {shape[-2]} tokens; no communication")


def _grid_note(plan) -> list[str]:
    """Grid modes: the tp sub-mesh, what each rank holds, and (2D, 2.5D) which form each linear runs."""
    tp = plan.tp_plan
    size = dict(tp.axes)
    params = sum(s.param_bytes for s in plan.stages)
    acts = sum(s.activation_bytes for s in plan.stages)
    grid = " x ".join(f"{a} {n}" for a, n in tp.axes)
    rows = batch_ways(tp.axes)
    if "tp_x" in size:
        what = (f"activations B/{rows} rows (tp_x and one of tp_y / tp_z) and C/{size['tp_y']} channels (the "
                f"other); weights split over all three axes")
    else:
        what = (f"activations B/{rows} rows over {'tp_dep and ' if 'tp_dep' in size else ''}tp_row, "
                f"C/{size['tp_col']} channels over tp_col; weights split {size['tp_col'] ** 2} ways"
                f"{', whole over tp_dep (gradients summed over it)' if 'tp_dep' in size else ''}")
    mode = plan.tp_mode + (f" -> {tp.mode}" if tp.mode else "")
    lines = [f"tensor parallel (tp={tp.tp}, {mode}): {grid}, tp rank in mixed radix over them; {what}; "
             f"{len(tp.sharded)} parameters split; per tp rank: params {_bytes(params)}, saved activations "
             f"{_bytes(acts)} per microbatch"]
    forms: dict = {}
    for layer, form in tp.forms:
        forms.setdefault(form, []).append(layer)
    if forms:
        lines.append("  linear_2d forms (cost model, per layer): " +
                     "; ".join(f"{form}: {len(layers)} ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''})"
                               for form, layers in forms.items()))
    return lines


def _dp_note(plan) -> str:
    """Data-parallel memory and traffic (cost_model/sharding.py): what ``memory`` counts, per stage."""
    how = {None: "replicated: memory has 4 x params (parameter, gradient, Adam moments); one all-reduce",
           "stage": "sharded per stage (dp_shard): memory has 4 x params / dp, plus unsharded parameters and "
                    "gradients during the step; one all-gather and one reduce-scatter",
           "layer": "sharded per layer (dp_shard): memory has 4 x params / dp, plus unsharded gradients and "
                    "two layers' parameters during the step; 2 x microbatches all-gathers, one reduce-scatter"}
    traffic = ", ".join(f"{_bytes(s.dp_bytes)} {s.dp_time * 1e3:.3f} ms" for s in plan.stages)
    return f"data parallel (dp={plan.mesh.dp}) {how[plan.dp_shard]} per step; per stage: {traffic}"


def stage_info_dict(stage: StageInfo) -> dict:
    d = asdict(stage)
    d["time"] = stage.time
    return d


def plan_dict(plan) -> dict:
    ours, equal = plan.balance()
    return {
        "mesh": {"pp": plan.mesh.pp, "cp": plan.mesh.cp, "tp": plan.mesh.tp, "dp": plan.mesh.dp},
        "tp_mode": plan.tp_mode, "schedule": plan.schedule, "chunks_per_rank": plan.chunks_per_rank,
        "num_microbatches": plan.num_microbatches, "device": plan.device,
        "example_shapes": [list(s) for s in plan.example_shapes],
        "autocast": plan.autocast, "recompute": plan.recompute, "dp_shard": plan.dp_shard,
        "balance": {"autosplit": ours, "equal_layer_count": equal,
                    "equal_layer_stage_times": plan.equal_layer_times, "baseline": BASELINE},
        "unknown_ops": plan.unknown_ops,
        "tensor_parallel": None if plan.tp_plan is None else {
            "tp": plan.tp_plan.tp, "regions": plan.tp_plan.regions, "notes": plan.tp_plan.notes,
            "sharded": {k: {"dims": v.dims, "full_shape": list(v.full_shape)} for k, v in plan.tp_plan.sharded.items()},
            "partial_grads": sorted(plan.tp_plan.partial_grads),
            "linear_2d_forms": dict(plan.tp_plan.forms)},
        "stages": [stage_info_dict(s) for s in plan.stages],
        "nodes": [_node_dict(n) for n in plan.graph.graph.nodes],
    }


def _node_dict(node) -> dict:
    val = node.meta.get("val")
    cost = node.meta.get("cost")
    d = {"name": node.name, "op": node.op, "target": str(node.target),
         "module_path": node.meta.get("module_path", ""), "stage": node.meta.get("stage"),
         "spec": str(node.meta["spec"]) if "spec" in node.meta else None}
    if hasattr(val, "shape"):
        d["shape"], d["dtype"] = list(val.shape), str(val.dtype).removeprefix("torch.")
    if cost is not None:
        d["fwd_flops"], d["bwd_flops"], d["saved_bytes"] = cost.fwd_flops, cost.bwd_flops, cost.saved_bytes
    return d
