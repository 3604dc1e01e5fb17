"""What every autosplit planning pass shares: the metadata contract, the plan state, the pass manager.

Every step of ``autosplit.compile`` is a ``MetaPass`` (a ``torch.fx.passes.infra.pass_base.PassBase``,
whose ``__call__`` runs ``requires``, ``call``, ``ensures``), and ``run_passes`` runs them all under one
``torch.fx.passes.infra.pass_manager.PassManager``.  A pass declares:
  requires_meta / ensures_meta   -- ``node.meta`` keys every node must have before / after it;
  requires_state / ensures_state -- ``PlanState`` fields it reads / sets (the plan-level results that
                                    are not node metadata: the tensor-parallel plan, the cuts, the
                                    stage bounds, ...).
The checks name the first node (or field) that breaks the contract, and ``run_passes`` derives the
ordering constraints from the declarations (a pass that requires a key or field runs after the pass
that ensures it), so a reordered pipeline is refused before anything runs.

Node metadata keys (``node.meta[...]``):
  module_path -- str: dotted name of the module the node came from, "" for the root    (autosplit/trace.py)
  val         -- the node's value on meta tensors: a tensor, a tuple of them, or a Python value; its
                 shapes are the local shapes of tp rank 0 after the tensor-parallel rewrite
                                                   (passes/shape_prop.py; dtypes: passes/autocast_prop.py)
  spec        -- dict mesh axis -> torch.distributed.tensor placement (Shard(dim), Replicate(), Partial()):
                 ``{"tp": ...}`` for 1D and tp = 1, ``{"tp_row": ..., "tp_col": ...}`` for 2D; dp never
                 shards a node's value (it splits the batch rows).  On every traced node; nodes the
                 rewrite inserts (collectives) may have none  (passes/tensor_parallel.py, passes/sharding/lower.py)
  tp_random   -- bool, on attention nodes whose dropout sees this rank's heads only: the stage forks the
                 random generator per tp rank there                       (passes/sharding/lower.py)
  cost        -- ``cost_model.NodeCost``: FLOPs, bytes, saved activations      (cost_model/annotate.py)
  stage       -- int: the global pipeline stage the node runs in            (passes/assign_stages.py)
(``nn_module_stack`` is torch.fx's own, read by tracing only.)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn
from torch.fx.passes.infra.pass_base import PassBase, PassResult
from torch.fx.passes.infra.pass_manager import PassManager, this_before_that_pass_constraint

from autosplit.errors import REPORT, AutosplitError, PlanError


@dataclass
class PlanState:
    """Inputs and plan-level results of the planning passes (``autosplit/compiler.py`` builds one).

    Inputs (set before the passes run): model, inputs (one example microbatch, a tuple of tensors),
    mesh (MeshShape), options (autosplit.options.PlanOptions), profile (DeviceProfile), num_microbatches
    (resolved), n_stages (pp * chunks_per_rank), budget (bytes or None), leaves (leaf module classes),
    layers (model_layers.layer_paths).  Results: the fields below, each set by the pass that ensures it.
    """

    model: nn.Module
    inputs: tuple
    mesh: object
    options: object
    profile: object
    num_microbatches: int
    n_stages: int
    budget: float | None
    leaves: tuple
    layers: list[str]
    tp_plan: object = None          # TensorParallelPlan (passes/sharding/tp_plan.py); None when tp = 1
    schedule_result: object = None  # schedule.SimResult of the schedule (deadlock-free, its peak activations)
    placement: object = None        # schedule.Placement: which stage each (pipeline rank, chunk) runs
    in_flight: list[int] = None     # per stage, microbatches held at the schedule's peak
    unknown_ops: list[str] = None   # ops the cost model has no rule for (cost_model/annotate.py)
    cuts: list = None               # passes/cut_points.Cut, in graph order
    segments: list = None           # lists of nodes between consecutive cuts
    costs: object = None            # autosplit.segment_costs.SegmentCosts of the segments
    bounds: list[int] = None        # last segment of each stage
    dp_shard: str | None = None     # the dp sharding chosen: None (replicated), "stage" or "layer"
    dp_costs: object = None         # cost_model.sharding.StageDataParallel for that choice
    baseline_bounds: list[int] | None = None   # torchtitan's equal-layer cut; None where it has none
    baseline_times: list[float] | None = None  # its stage costs
    layer_ends: list[int] = None    # per layer (model_layers.layer_paths), the segment it ends in
    split: object = None            # passes/split_stages.SplitStages that ran (modules, inputs, outputs)
    stage_infos: list = None        # autosplit.stage_info.StageInfo per stage
    produced: set[str] = field(default_factory=set, repr=False)

    def put(self, **results) -> None:
        """Set result fields, recording that they are produced (``ensures_state`` checks this)."""
        for name, value in results.items():
            if name not in self._result_names():
                raise AttributeError(f"PlanState has no result field {name!r}")
            setattr(self, name, value)
        self.produced.update(results)

    @classmethod
    def _result_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


class MetaPass(PassBase):
    """A graph pass with declared node-metadata and plan-state contracts (see the module docstring).

    Passes that produce plan-level results take the ``PlanState`` as ``self.state``.
    """

    requires_meta: tuple[str, ...] = ()
    ensures_meta: tuple[str, ...] = ()
    requires_state: tuple[str, ...] = ()
    ensures_state: tuple[str, ...] = ()
    state: PlanState | None = None

    def _check(self, module, keys: tuple[str, ...], when: str) -> None:
        if not keys:
            return
        for node in module.graph.nodes:
            for key in keys:
                if key not in node.meta:
                    raise RuntimeError(
                        f"{type(self).__name__} {when}: node '{node.name}' ({node.op} {node.target}) "
                        f"has no meta['{key}']; run the pass that sets it first")

    def _check_state(self, names: tuple[str, ...], when: str) -> None:
        missing = [n for n in names if self.state is None or n not in self.state.produced]
        if missing:
            raise RuntimeError(f"{type(self).__name__} {when}: plan state {missing} not produced; "
                               f"run the pass that sets it first")

    def __call__(self, graph_module) -> PassResult:
        """``requires``, ``call``, then ``ensures`` on the module the pass returns (PassBase checks the
        module it was given, which is not the result for a pass that builds a new GraphModule)."""
        self.requires(graph_module)
        result = self.call(graph_module)
        self.ensures(result.graph_module)
        return result

    def requires(self, graph_module: fx.GraphModule) -> None:
        self._check(graph_module, self.requires_meta, "requires")
        self._check_state(self.requires_state, "requires")

    def ensures(self, graph_module: fx.GraphModule) -> None:
        self._check(graph_module, self.ensures_meta, "ensures")
        self._check_state(self.ensures_state, "ensures")


def _needs(p) -> set[str]:
    return {f"meta:{k}" for k in getattr(p, "requires_meta", ())} | {f"state:{k}" for k in getattr(p, "requires_state", ())}


def _gives(p) -> set[str]:
    return {f"meta:{k}" for k in getattr(p, "ensures_meta", ())} | {f"state:{k}" for k in getattr(p, "ensures_state", ())}


def ordering_constraints(passes: list[MetaPass]) -> list:
    """``this_before_that`` constraints from the declarations: each requirement of a pass is met by
    the nearest earlier pass that ensures it (or, if none is earlier, the first later one, which the
    pass manager then reports as out of order)."""
    constraints = []
    for i, consumer in enumerate(passes):
        for need in sorted(_needs(consumer)):
            earlier = [p for p in passes[:i] if need in _gives(p)]
            later = [p for p in passes[i + 1:] if need in _gives(p)]
            if not earlier and not later:
                raise RuntimeError(f"{type(consumer).__name__} requires {need}, which no pass of the pipeline "
                                   f"ensures: {[type(p).__name__ for p in passes]}")
            producer = earlier[-1] if earlier else later[0]
            constraints.append(this_before_that_pass_constraint(producer, consumer))
    return constraints


def run_passes(passes: list[MetaPass], module: nn.Module) -> nn.Module:
    """Run ``passes`` in the given order under torch.fx's PassManager; returns the last pass's module.

    The order is checked against ``ordering_constraints`` before anything runs.  PassManager wraps
    any error in a bare ``Exception`` naming the pass; we re-raise the pass's own error instead (an
    AutosplitError must reach the user as itself, with its message), with the pass named in a note.
    Any other exception is a bug of ours, not bad input: it leaves as a PlanError that names the pass
    and says so (the rules that know the node name it themselves, autosplit/errors.py ``at_node``).
    """
    manager = PassManager(passes, constraints=ordering_constraints(passes))
    manager.validate_constraints()        # raises on a pass placed before what it requires; no reordering
    try:
        return manager(module).graph_module
    except Exception as wrapper:          # noqa: BLE001  (PassManager's wrapper: unwrap, re-raise the cause)
        cause = wrapper.__cause__
        if cause is None:
            raise
        if not isinstance(cause, AutosplitError):
            # not bad input (that is an AutosplitError, raised where it is found): our own code failed
            failed = str(wrapper).split("'")[1] if str(wrapper).count("'") >= 2 else "a planning pass"
            bug = PlanError(f"planning pass {failed} failed: {type(cause).__name__}: {cause}; {REPORT}")
            bug.add_note(str(wrapper))
            raise bug from cause
        if hasattr(cause, "add_note"):
            cause.add_note(str(wrapper))
        cause.__suppress_context__ = True
        raise cause
