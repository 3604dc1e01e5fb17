"""The Plan: what autosplit decided, as plain data, plus the per-stage GraphModules that carry it out.

Terms:
  stage  -- global pipeline stage s; which stage chunk c of pipeline rank r runs is the schedule's
            placement (``plan.placement``): looped ``c * pp + r`` (Megatron's interleaved schedule),
            or zb-v's V (rank r holds stages r and 2*pp-1-r).
  layers -- a readable summary of the module paths a stage covers ("blocks.0-3, blocks.4.attn").
  memory -- predicted peak bytes of one stage on its rank: parameters, gradients and two optimizer
            moments (4 x parameter bytes), plus the activations kept for backward times the number of
            microbatches the schedule keeps in flight on that stage, plus (with checkpointing) what one
            microbatch's recomputation holds (see segment_costs.py).
  baseline -- torchtitan's cut (passes/partition.py ``torchtitan_bounds``): equal units per stage where
            the embedding and the head each count as one layer; None where that rule has no cut.
  batch norms -- the layers that normalize with batch statistics (passes/batch_norm.py); with more than
            one microbatch or replica the summary ends with a note on what they compute.

A Plan is pure: building one needs no process group and no GPU.  The runtime interprets it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autosplit.errors import AutosplitError, RankError
from autosplit.mesh import MeshShape
from autosplit.passes.batch_norm import BatchNormLayer, batch_norm_note
from autosplit.passes.sharding.describe import explain
from autosplit.report.dump import dump_plan
from autosplit.report.summary import plan_dict, summary_table
from autosplit.schedule.placement import Placement, placement_of
from autosplit.stage_info import StageInfo, TensorInfo

__all__ = ["Plan", "StageInfo", "TensorInfo"]


@dataclass
class Plan:
    mesh: MeshShape
    tp_mode: str
    schedule: str
    chunks_per_rank: int
    num_microbatches: int
    device: str
    example_shapes: list[tuple[int, ...]]
    example_dtypes: list[str]
    stages: list[StageInfo]
    equal_layer_times: list[float] | None     # stage costs of torchtitan's cut (the baseline); None: n/a
    equal_layer_bounds: list[int] | None      # that cut, as stage_bounds (to run it for comparison)
    unknown_ops: list[str]
    bounds: list[int]                         # last segment of each stage (see passes/partition.py)
    graph: fx.GraphModule = field(repr=False)  # the whole traced graph, annotated
    modules: list[fx.GraphModule] = field(repr=False)
    schedule_grid: str = field(default="", repr=False)
    tp_plan: object = field(default=None, repr=False)   # passes.sharding.tp_plan.TensorParallelPlan when tp > 1
    autocast: str | None = None               # "bfloat16" / "float16" when planned for torch.autocast
    recompute: str | None = None             # None, "stage" or "block"
    layer_end_segments: list[int] = field(default_factory=list)   # per layer, the segment it ends in
    dp_shard: str | None = None               # "stage" / "layer": FSDP2 units over dp; None: replicated
    profile: object = field(default=None, repr=False)   # the cost_model.DeviceProfile it was priced with
    batch_norms: list[BatchNormLayer] = field(default_factory=list)   # batch-statistics layers, graph order
    cp_attention: str = "auto"                # with a cp axis: how attention was lowered (PlanOptions)
    _tp_modules: dict = field(default_factory=dict, repr=False)

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def placement(self) -> Placement:
        """Which stage each (pipeline rank, chunk) runs: the schedule's placement."""
        return placement_of(self.schedule, self.mesh.pp, self.chunks_per_rank)

    def stage_modules(self, pp_rank: int, tp_rank: int = 0) -> list[fx.GraphModule]:
        """The GraphModules pipeline rank ``pp_rank`` runs, one per chunk, in stage order."""
        for name, rank, size in (("pp_rank", pp_rank, self.mesh.pp), ("tp_rank", tp_rank, self.mesh.block)):
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < size:
                axis = name.removesuffix("_rank")
                raise RankError(f"stage_modules: {name}={rank!r} is outside 0..{size - 1} ({axis}={size})")
        return [self._module(s, tp_rank) for s in self.placement.stages(pp_rank)]

    def _module(self, stage: int, tp_rank: int) -> fx.GraphModule:
        if tp_rank == 0:
            return self.modules[stage]
        key = (stage, tp_rank)
        if key not in self._tp_modules:
            graph = self.modules[stage].graph
            module = fx.GraphModule(self.tp_plan.local_root(tp_rank, graph), graph, f"Stage{stage}")
            same_order(module, self.modules[stage])
            self._tp_modules[key] = module
        return self._tp_modules[key]

    def balance(self) -> tuple[float, float | None]:
        """max/mean predicted stage time: (autosplit's cut, torchtitan's cut).  The second is None where
        torchtitan's rule has no cut (fewer layers, embedding and head included, than stages)."""
        ours = [s.time for s in self.stages]
        base = self.equal_layer_times
        return max(ours) / (sum(ours) / len(ours)), None if base is None else max(base) / (sum(base) / len(base))

    def summary(self) -> str:
        return "\n".join([summary_table(self), *self.batch_norm_note()])

    def predicted_step(self, device=None, optimizer="adamw"):
        """The predicted seconds of one training step (``pm.step``: forward and backward of every
        microbatch, tp, pp and dp communication, then ``opt.step()``), the number ``autosplit.search``
        ranks by.

        Returns a ``cost_model.step_time.StepPrediction`` of the slowest pipeline rank: ``.total`` =
        ``.compute`` + ``.tp_comm`` + ``.pp_comm`` + ``.dp_comm`` + ``.bubble`` + ``.optimizer`` (exposed
        seconds of each; ``.dp_comm`` includes FSDP's exposed all-gathers and the step's own loss
        all-reduces), with ``.rank`` and ``.line()``.

        Args:
            device: the profile to price with (a name, a profile file or a DeviceProfile); default the
                profile the plan was compiled with (``plan.profile``), which states the node size.
            optimizer: the optimizer the job steps with: a torch.optim class (SGD, Adam, AdamW), an
                instance (its momentum, weight decay, ``fused`` count), or "sgd", "sgd_momentum", "adam",
                "adamw" (default); priced over the parameters each rank owns (cost_model/optimizer_step.py).
        """
        from autosplit.cost_model.step_time import predict_plan
        return predict_plan(self, device, optimizer)

    def explain(self, target: str) -> str:
        """How the sharding engine priced one op: each candidate strategy (its output's and operands'
        placements on the tp axis), its compute and the redistribution from its producers' chosen
        placements, in ms per microbatch (forward + backward), the chosen one marked.

        Args:
            target: a node name of ``plan.graph`` (as the dumps and ``plan.tp_plan.regions`` show it)
                or a module path (every node of that module).
        """
        sharding = getattr(self.tp_plan, "sharding", None)
        if self.tp_plan is None:
            raise AutosplitError(f"explain('{target}'): tp = 1, nothing is split; plan with a mesh whose tp > 1")
        if sharding is None:
            raise AutosplitError(f"explain('{target}'): tp_mode='{self.tp_mode}' plans are not priced per op; "
                                 f"tp_mode='1d' plans are")
        return explain(sharding, target)

    def batch_norm_note(self) -> list[str]:
        """What the BatchNorm layers compute under this plan's microbatches and replicas (lines; empty
        when every forward sees the step's whole batch or there is no such layer)."""
        first = self.example_shapes[0] if self.example_shapes else ()
        return batch_norm_note(self.batch_norms, self.num_microbatches, self.mesh.dp, first[0] if first else None,
                               self.recompute)

    def to_dict(self) -> dict:
        d = plan_dict(self)
        if self.batch_norms:        # plan.json: the layers, and the note where one is due
            d["batch_norm"] = {"layers": [vars(layer) for layer in self.batch_norms], "note": self.batch_norm_note()}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def dump(self, directory) -> list[str]:
        """Write per-rank code, a graph drawing per stage, plan.json, summary.txt, schedule.txt."""
        return dump_plan(self, directory)


def same_order(module: torch.nn.Module, like: torch.nn.Module) -> None:
    """Register ``module``'s submodules, parameters and buffers in ``like``'s order (names ``like`` lacks
    after its own).  A stage module of block rank > 0 is built from the graph, rank 0's from the model, and
    their orders differed; FSDP2 flattens a unit's parameters in registration order and all-gathers the
    flat buffer, so with cp (units over dp x cp, ranks of other block coordinates) another order on one
    rank gathered its shards into the wrong parameters: a wrong forward under dp_shard="stage"."""
    for name, sub in list(module.named_modules()):
        try:
            ref = like.get_submodule(name)
        except AttributeError:
            continue
        for table in ("_modules", "_parameters", "_buffers"):
            mine, theirs = getattr(sub, table), getattr(ref, table)
            order = [k for k in theirs if k in mine] + [k for k in mine if k not in theirs]
            items = [(k, mine[k]) for k in order]
            mine.clear()
            mine.update(items)
