"""Before the first step: every rank checks that all ranks planned the same job and hold the same model.

Terms:
  field       -- one thing a plan decided, as readable text: mesh, schedule, num_microbatches,
                 microbatch (shapes and dtypes), stages (bounds and per-stage input/output shapes and
                 dtypes), tp plan, cost profile.  ``plan_fields`` is a pure function of the Plan.
  fingerprint -- ``plan_fingerprint(plan)``: a stable hash of all fields.
  checksum    -- an exact integer digest of one tensor's bytes: the position-weighted sum of its bit
                 patterns, mod 2**64.  Integer sums do not depend on the reduction order, so equal
                 tensors give equal checksums on every rank.
  agreement   -- ``check_agreement``: ONE all_gather over WORLD of a small fixed-size int64 row
                 (a nonce, an error flag, one hash per field, one hash of all parameter checksums).
                 Only when rows differ do ranks share readable texts (through the store) and, if the
                 parameters differ, gather the per-tensor checksums to name the tensors.  Every rank
                 then raises the same AutosplitError.

Why a checksum compare and not a broadcast (as DDP does): replicas along dp hold the same tensors, but
tp ranks hold different shards cut from *their own* copy of the full model, and pp ranks different
stages; a broadcast over dp could not repair a tp or pp mismatch, and a full-model broadcast from rank 0
would cost a copy of the whole model per rank.  Every rank still holds the user's full model before the
first step, so comparing checksums of every tensor of it over WORLD catches every kind of mismatch
(dp, tp and pp) at the price of reading the model once, and names the tensors.  It runs when a rank's
model is known to be whole: before the first step and after ``load_full_state_dict`` (after training,
the user's model object holds only this rank's trained stages).
"""
from __future__ import annotations

import json

import torch

from autosplit.errors import AutosplitError
from autosplit.runtime.faults.exchange import by_value, gather_rows, nonce, share_texts, stable_hash, who

_FIELDS = ("mesh", "schedule", "num_microbatches", "microbatch", "stages", "tp plan", "cost profile", "model")
_NAMED = 5            # tensors named in a parameter-mismatch error


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit] + " ..."


def _tensors(infos) -> str:
    return ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in infos)


def plan_fields(plan) -> dict[str, str]:
    """What ``plan`` decided, field by field, as readable text (pure; the same on every rank)."""
    tp = plan.tp_plan
    tp_text = f"{plan.tp_mode}, tp={plan.mesh.tp}" + (f", cp={plan.mesh.cp}" if plan.mesh.cp > 1 else "")
    if tp is not None:
        sharded = ", ".join(f"{n}/dims{s.dims}" for n, s in sorted(tp.sharded.items()))
        tp_text += f"; sharded {sharded}; partial grads {sorted(tp.partial_grads)}"
    stages = "; ".join(f"stage {s.index}: in [{_tensors(s.inputs)}] out [{_tensors(s.outputs)}]"
                       for s in plan.stages)
    return {
        "mesh": str(plan.mesh),
        "schedule": f"{plan.schedule} (chunks_per_rank={plan.chunks_per_rank})",
        "num_microbatches": str(plan.num_microbatches),
        "microbatch": ", ".join(f"{tuple(s)} {d}" for s, d in zip(plan.example_shapes, plan.example_dtypes)),
        "stages": f"bounds {list(plan.bounds)}; {stages}",
        "tp plan": tp_text,
        "cost profile": str(plan.device),
    }


def plan_fingerprint(plan) -> int:
    """A stable hash of what ``plan`` decided (see ``plan_fields``)."""
    return stable_hash(json.dumps(plan_fields(plan), sort_keys=True))


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(flat.element_size(), torch.uint8)
    return flat.view(ints).to(torch.int64)


def model_checksums(model: torch.nn.Module, device=None) -> tuple[list[str], list[int]]:
    """(names, checksums) of every tensor of ``model.state_dict()``; meta tensors count 0.
    ``device``: where to compute (a GPU reads a CPU-resident model faster than the CPU sums it).
    Blocks the host on a GPU (``.cpu()``): call it through ``Watchdog.blocking``."""
    names, sums = [], []
    for name, t in model.state_dict().items():
        names.append(name)
        if t.device.type == "meta" or t.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.int64))
            continue
        bits = _bits(t.to(device) if device is not None else t)
        weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device)
        sums.append((bits * weights).sum().cpu())   # wraps mod 2**64, the same on every rank
    return names, torch.stack(sums).tolist() if sums else []


def _model_field(model: torch.nn.Module) -> tuple[str, str]:
    state = model.state_dict()
    text = f"{len(state)} tensors, {sum(t.numel() for t in state.values())} elements"
    return text, ";".join(f"{n}{tuple(t.shape)}{t.dtype}" for n, t in state.items())


def check_agreement(world, watchdog, plan, model, check_params: bool, error: str | None = None) -> None:
    """Raise the same AutosplitError on every rank unless all ranks planned the same job (and, with
    ``check_params``, hold the same model).  ``error``: this rank's own problem, reported everywhere.

    Args:
      world: the runtime World (rank, size, device, store).
      watchdog: bounds every wait.
      plan: this rank's Plan (may be None when ``error`` says why there is none).
      model: the user's full model.
      check_params: also compare checksums of every tensor of ``model``.
      error: a problem this rank found; every rank raises it, naming this rank.
    """
    texts = plan_fields(plan) if plan is not None else {f: "(no plan)" for f in _FIELDS[:-1]}
    model_text, model_key = _model_field(model)
    texts["model"] = model_text
    keys = dict(texts, model=model_key)
    names, sums = [], []
    if check_params and error is None:
        # a blocking call (deadlines.py): on a GPU every ``.cpu()`` waits for the device's queue, and on
        # any device a rank that stops here would leave its peers waiting in the gather below while it
        # never reaches its own deadline; this way a stop ends every rank, naming this one and the action
        names, sums = watchdog.blocking(lambda: model_checksums(model, world.device), "parameter checksums")
    row = [nonce(), int(error is not None)] + [stable_hash(keys[f]) for f in _FIELDS] + [stable_hash(str(sums))]
    rows = gather_rows(world, watchdog, row, "plan agreement")
    if all(r[1:] == rows[0][1:] for r in rows) and not rows[0][1]:
        return
    doing = "plan agreement (sharing what differs)"
    shared = [json.loads(s) for s in share_texts(world, watchdog, rows[0][0], json.dumps(
        {"fields": texts, "error": error}), doing)]
    problems = [f"{who(ranks, world)}: {err}" for ranks, err in by_value([s["error"] or "" for s in shared]) if err]
    if problems:
        raise AutosplitError("a rank could not plan the job, so no rank runs it: " + "; ".join(problems))
    for i, field in enumerate(_FIELDS):
        if len({r[2 + i] for r in rows}) > 1:
            groups = by_value([_short(s["fields"][field]) for s in shared])
            if len(groups) == 1:       # same readable text, different content: show the hashes
                groups = by_value([f"{_short(s['fields'][field])} (hash {r[2 + i]:x})" for s, r in zip(shared, rows)])
            said = [f"{who(ranks)} planned {field}={value}" if k == 0 else f"{who(ranks)} planned {value}"
                    for k, (ranks, value) in enumerate(groups)]
            problems.append(", ".join(said))
    if problems:
        raise AutosplitError("ranks planned different jobs: " + "; ".join(problems) + ". Every rank must call "
                             "parallelize with the same arguments and model, and step with the same shapes")
    raise AutosplitError(_params_message(world, watchdog, names, sums))


def _params_message(world, watchdog, names: list[str], sums: list[int]) -> str:
    """The model's structure agrees (same keys and shapes), so every rank gathers len(names) checksums."""
    rows = gather_rows(world, watchdog, sums, "parameter checksum comparison")
    differing = [i for i in range(len(names)) if len({r[i] for r in rows}) > 1]
    odd = [r for r in range(world.size) if any(rows[r][i] != rows[0][i] for i in differing)]
    shown = ", ".join(f"'{names[i]}'" for i in differing[:_NAMED])
    more = f" (and {len(differing) - _NAMED} more)" if len(differing) > _NAMED else ""
    return (f"the model's parameters differ between ranks: {who(odd)} hold{'s' if len(odd) == 1 else ''} "
            f"different values than rank 0 for {shown}{more}, {len(differing)} of {len(names)} tensors. Every "
            f"rank must build the same model (the same torch.manual_seed before creating it) or load the same "
            f"state dict")
