"""``PlanOptions``: every planning option, one typed and documented dataclass.

``autosplit.compile``, ``autosplit.parallelize`` and the command line (``autosplit plan``) all take
these options; each builds a ``PlanOptions`` from its keyword arguments (``from_kwargs``), so a
misspelled option is refused with its name and the valid ones, and ``check`` is the one validator of
their values (the schedule's arithmetic is ``autosplit.schedule.generate.validate``'s, called from here).

Terms:
  mesh     -- ``autosplit.mesh.MeshShape`` (pp, tp, dp); ``check`` needs it for the checks that
              depend on the number of stages or on tp (2D's q x q grid).
  option   -- a field below; ``mesh``, ``example_input`` and the runtime's own arguments (loss_fn,
              timeout_s, bucket_mb, seed, init_fn) are not options of the plan.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from autosplit import validate
from autosplit.deprecated import RENAMED_OPTIONS, renamed_keywords, warn_renamed
from autosplit.errors import AutosplitError
from autosplit.passes.tensor_parallel import LINEAR_2D_FORMS
from autosplit.tp.axes import GRID_MODES, tp_axes
from autosplit.schedule.generate import SCHEDULES, SPLIT_BACKWARD
from autosplit.schedule.generate import validate as validate_schedule
from autosplit.segment_costs import RECOMPUTE

TP_MODES = ("1d", "2d", "2.5d", "3d", "auto")
TP_2D_FORMS = ("auto",) + LINEAR_2D_FORMS
CP_ATTENTION = ("auto", "gather", "all_to_all")      # passes/sharding/context.py *attention lowering*
AUTOCAST = (None, torch.bfloat16, torch.float16)
DP_SHARD = (False, None, True, "stage", "layer", "auto")     # None: as False; True: as "auto"
_UNSET = type("Unset", (), {"__repr__": lambda self: "<not given>"})()


def check_dp_shard(value) -> None:
    """``dp_shard`` alone (``parallelize`` checks it before any rendezvous; ``PlanOptions.check`` too)."""
    if value not in DP_SHARD:
        raise AutosplitError(f"dp_shard={value!r}: expected False, 'stage', 'layer' or 'auto' (the cost model "
                             f"chooses; True means the same)")


@dataclass
class PlanOptions:
    """How to plan a model; every field is also a keyword of ``compile`` / ``parallelize`` and a flag
    of ``autosplit plan`` (``--tp-mode``, ``--memory-budget``, ...).

    Args:
        tp_mode: "1d" (Megatron: every Linear weight split by rows or columns, attention by heads),
            "2d" (SUMMA/Optimus on a q x q grid; tp must be a perfect square), "2.5d" (Tesseract: tp_depth
            layers of a q x q grid, tp = q * q * tp_depth), "3d" (a q x q x q cube) or "auto" (the sharding
            engine's free choice over one tp axis: the least predicted step time whose per-rank
            memory fits ``memory_budget``, or the device's memory; layers may stay whole).
        schedule: the pipeline schedule, one of ``autosplit.schedule.SCHEDULES`` ("gpipe", "1f1b",
            "interleaved", "zb-h1", "zb-v").
        chunks_per_rank: model chunks (stages) per pipeline rank: 1, >= 2 for "interleaved", 2 for "zb-v".
        num_microbatches: microbatches per optimizer step; None means 2 * pp (``compile`` only).
        device: the cost model's profile: "h100", "h200", "a100", "cpu" (measured here) or a
            ``cost_model.DeviceProfile``.  None (``parallelize`` only): the GPU's built-in profile, or
            on CPU this machine measured by rank 0.
        memory_budget: bytes per stage the cut must respect: a number, or a string such as "8GiB",
            "512MiB", "1.5GB"; None: no limit.
        leaf_modules: module classes torch.fx must not trace into: classes, "package.module.ClassName",
            or a class name that names one class among the model's submodules.
        concrete_args: values for forward parameters after the example inputs ({name: value}).
        stage_bounds: reuse another plan's cut (``plan.bounds``) instead of searching, e.g. to re-plan
            the same model for a new batch size keeping every parameter on the same rank.
        sequence_parallel: with tp_mode="1d" and tp > 1, also shard the token dim between
            tensor-parallel regions.
        autocast: None, torch.bfloat16 or torch.float16: plan for training under ``torch.autocast``
            (matmuls at the half-precision peak, activations and boundaries in the dtype autocast gives).
        recompute: None, "stage" or "block": activation recomputation (torch.utils.checkpoint) per stage or
            per layer: keep fewer activations, run their forward again in backward.  The old keyword
            ``checkpoint=`` still works for one release, with a DeprecationWarning.
        tp_depth: with tp_mode="2.5d", d in tp = q * q * d: the batch is split d * q ways, weights
            q * q ways and kept whole over the d layers (their gradients summed over ``tp_dep``).
        tp_2d_form: with tp_mode="2d" or "2.5d", how each linear multiplies its blocks: "allgather", "summa"
            or "auto" (whichever the cost model prices lower, per layer).
        dp_shard: False (replicated dp), "stage" or "layer" (FSDP2 units over dp), or "auto": "stage"
            where it fits ``memory_budget``, else "layer".  True means "auto" (and is what "auto" is
            stored as).
        tp_overlap_chunks: with tp > 1, split the rows of each stretch of row-wise ops around a
            forward all-reduce into this many chunks, so that one chunk's all-reduce runs while
            another chunk computes (passes/tp_overlap.py); 1: off.  Where the graph has no forward
            all-reduce (sequence parallelism reduce-scatters; 2D) nothing changes.
        cp_attention: with a cp axis, how each attention gets the tokens it needs: "gather" (its keys and
            values all-gathered over cp), "all_to_all" (DeepSpeed-Ulysses: tokens split -> heads split and
            back, where cp divides the heads) or "auto" (the cost model's choice, per attention).
    """

    tp_mode: str = "1d"
    schedule: str = "1f1b"
    chunks_per_rank: int = 1
    num_microbatches: int | None = None
    device: object = "h100"
    memory_budget: float | str | None = None
    leaf_modules: Sequence = ()
    concrete_args: dict | None = None
    stage_bounds: Sequence[int] | None = None
    sequence_parallel: bool = False
    autocast: torch.dtype | None = None
    recompute: str | None = None
    tp_2d_form: str = "auto"
    tp_depth: int | None = None
    dp_shard: bool | str = False
    tp_overlap_chunks: int = 1
    cp_attention: str = "auto"
    # the deprecated spelling of ``recompute`` (autosplit/deprecated.py): an init-only argument, not a field
    checkpoint: dataclasses.InitVar[str | None] = _UNSET

    def __post_init__(self, checkpoint):
        if isinstance(self.dp_shard, str) and self.dp_shard == "auto":
            self.dp_shard = True      # one value inside: True is the contract's spelling of "auto"
        if checkpoint is not _UNSET:
            if self.recompute is not None:
                raise AutosplitError("PlanOptions() got both recompute= and its deprecated spelling checkpoint=; "
                                     "pass recompute= only")
            warn_renamed("PlanOptions(checkpoint=...)", "recompute=", stacklevel=3)   # at the user's call
            self.recompute = checkpoint

    @classmethod
    def names(cls) -> list[str]:
        """The option names, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, caller: str, kwargs: dict, base: PlanOptions | None = None,
                    stacklevel: int = 3) -> PlanOptions:
        """``base`` (or the defaults) with ``kwargs`` applied; an unknown name is refused.

        Args:
            caller: the function named in the error, e.g. "parallelize".
            kwargs: option name -> value, as the caller received them.
            base: options given as a ``PlanOptions`` (``options=``); kwargs override its fields.
            stacklevel: where a deprecated keyword's warning points: 3 is the caller's caller (the user
                of ``compile``); add one per frame between.
        """
        kwargs = renamed_keywords(caller, kwargs, RENAMED_OPTIONS, stacklevel=stacklevel)
        unknown = sorted(set(kwargs) - set(cls.names()))
        if unknown:
            near = [validate.near_miss(k, cls.names()) for k in unknown]
            hints = "".join(f" (did you mean {n!r} for {k!r}?)" for k, n in zip(unknown, near) if n)
            raise AutosplitError(f"{caller}() got unknown option{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(map(repr, unknown))}{hints}; valid options: {', '.join(cls.names())}")
        if base is not None and not isinstance(base, PlanOptions):
            raise AutosplitError(f"{caller}(options={base!r}): expected an autosplit.options.PlanOptions")
        start = base if base is not None else cls()
        return dataclasses.replace(start, **kwargs)

    def changed(self, values: dict) -> dict:
        """The entries of ``values`` (option name -> a caller's keyword argument) that differ from this
        PlanOptions' fields: a keyword left at its default does not override ``options=``."""
        def same(name, v):
            default = getattr(self, name)
            return v is default or (type(v) is type(default) and v == default)
        return {k: v for k, v in values.items() if not same(k, v)}

    def check(self, mesh, *, microbatches_default: str = "") -> None:
        """Raise AutosplitError naming the first option whose value cannot be planned on ``mesh``.

        Args:
            mesh: the parsed ``MeshShape``.
            microbatches_default: appended to the num_microbatches error, e.g. " (or None for 2 * pp = 4)".
        """
        validate.one_of("tp_mode", self.tp_mode, TP_MODES)
        if self.tp_depth is not None and self.tp_mode != "2.5d":
            raise AutosplitError(f"tp_depth={self.tp_depth!r} applies to tp_mode='2.5d' (tp = q * q * tp_depth); "
                                 f"tp_mode is {self.tp_mode!r}")
        if self.tp_mode in GRID_MODES:
            axes = tp_axes(self.tp_mode, mesh.tp, self.tp_depth) if mesh.tp > 1 else ()
            if self.sequence_parallel and mesh.tp > 1:
                names = " and ".join(a for a, _ in axes)
                raise AutosplitError(f"sequence_parallel=True applies to tp_mode='1d'; tp_mode={self.tp_mode!r} "
                                     f"already splits every activation over {names} (batch rows and channels)")
        if getattr(mesh, "cp", 1) > 1 and (self.tp_mode != "1d" or self.sequence_parallel):
            what = f"tp_mode={self.tp_mode!r}" if self.tp_mode != "1d" else "sequence_parallel=True"
            raise AutosplitError(f"cp={mesh.cp} splits the tokens of every op over cp, beside 1D tensor parallelism "
                                 f"(tp_mode='1d') only; {what} with a cp axis is not built: use tp_mode='1d' "
                                 f"without sequence_parallel, or cp=1")
        if self.tp_mode == "auto" and self.sequence_parallel and mesh.tp > 1:
            raise AutosplitError("sequence_parallel=True applies to tp_mode='1d'; tp_mode='auto' already weighs "
                                 "splitting the tokens between blocks, by cost")
        validate.one_of("schedule", self.schedule, SCHEDULES)
        validate.positive_int("chunks_per_rank", self.chunks_per_rank)
        if self.num_microbatches is not None or not microbatches_default:
            validate.positive_int("num_microbatches", self.num_microbatches, microbatches_default)
        m = 2 * mesh.pp if self.num_microbatches is None else self.num_microbatches
        validate_schedule(self.schedule, mesh.pp, m, self.chunks_per_rank)     # the schedule's arithmetic
        if not any(self.autocast is a for a in AUTOCAST):
            raise AutosplitError(f"autocast={self.autocast!r}: expected None, torch.bfloat16 or torch.float16")
        validate.one_of("recompute", self.recompute, RECOMPUTE)
        if not isinstance(self.sequence_parallel, bool):
            raise AutosplitError(f"sequence_parallel={self.sequence_parallel!r}: expected True or False")
        validate.one_of("tp_2d_form", self.tp_2d_form, TP_2D_FORMS)
        check_dp_shard(self.dp_shard)
        validate.positive_int("tp_overlap_chunks", self.tp_overlap_chunks)
        validate.one_of("cp_attention", self.cp_attention, CP_ATTENTION)
        if self.schedule in SPLIT_BACKWARD and self.dp_shard:
            raise AutosplitError(
                f"schedule={self.schedule!r} with dp_shard={self.dp_shard!r}: FSDP2 reduce-scatters a module's "
                f"gradients when its backward ends, but a zero-bubble schedule computes the weight gradients "
                f"later, in W; use dp_shard=False (replicated dp) or schedule='1f1b'")
