"""Sharded data parallelism (``dp_shard``): each stage module sharded over the dp axis with torch's FSDP2.

Terms:
  unit        -- one ``fully_shard`` call: its parameters are all-gathered together before its forward
                 and their gradients reduce-scattered together.  Granularity "stage": one unit per stage
                 module; "layer": one unit per model layer the stage holds (the runs of
                 runtime/stage/checkpointing.py ``split_layers``, so that the layer is a module whose forward
                 is called and FSDP's hooks fire) plus the stage root for everything else.
  sharded     -- each parameter split along dim 0 over the dp ranks (FSDP2's ``Shard(0)`` DTensor); the
                 optimizer steps the shard, and gradients arrive reduce-scattered (averaged over dp).
  kept        -- "stage" keeps the stage's parameters unsharded from its first forward to its last
                 backward of a step (one all-gather per step); "layer" reshards a layer after its forward
                 and gathers it again for backward (2 x m all-gathers per step, about one layer's
                 parameters unsharded at a time, the next one prefetched).
  step sync   -- gradients accumulate unsharded over a step's microbatches; the reduce-scatter runs in
                 the stage's last backward of the step only (``set_requires_gradient_sync``, as
                 torch.distributed.pipelining does for FSDP stages), and not at all under ``no_sync``.
  cp          -- with a context-parallel axis the units shard over dp x cp (``World.grad_mesh``) and FSDP
                 averages over dp * cp ranks.  Each cp rank's gradient of most parameters is a part (its
                 tokens' share), whose sum over cp is wanted: those are multiplied by cp afterwards
                 (``ShardedGrads.finish``).  A parameter whose gradient is whole on every cp rank
                 (``tp_plan.whole_grads``) is right as averaged.  Why not FSDP2's divide factor: it
                 reduces with PREMUL_SUM, which gloo lacks, and one path must serve both backends.
  replicated  -- parameters whose gradient is a tensor-parallel partial sum (``tp_plan.partial_grads``:
                 norms under sequence parallelism, qk-norms) stay out of FSDP (``ignored_params``); the
                 ParallelModule sums them over tp and averages them over dp as without sharding.
  meta        -- a model built on the meta device: its stage copies are sharded while still meta, then
                 each rank allocates only its shards (FSDP2's ``to_empty`` recipe) and writes the values
                 ``autosplit.materialize`` gives on one device into them; the whole stage is never
                 allocated, and the plan's modules and the user's model stay on the meta device.
  own copy    -- the stage modules are deep copies: FSDP replaces parameters on the modules that hold
                 them, and with tp=1 those are the user's model's own modules, which the ranks compare
                 (agreement.py) and ``full_state_dict`` reads for other stages.

NCCL ordering: the ranks of a dp group share their pp and tp coordinates, so they run the same lowered
schedule over graphs of the same structure; FSDP issues its all-gathers and reduce-scatters from its
module hooks as that schedule calls forward and backward, so every rank of the group issues the same
collectives in the same order (the requirement for NCCL).  FSDP's own waits are bounded by the process
group's timeout (world.py sets ``timeout_s`` + a grace), not by our Watchdog; the heartbeat still names
the compute a rank is stuck in.
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable

import torch
import torch.fx as fx
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from autosplit.errors import AutosplitError
from autosplit.runtime.stage.checkpointing import Checkpointed, checkpointed, split_layers

GRANULARITIES = ("stage", "layer")
# FSDP warns when a unit returns a view, since an in-place op on it would skip its backward hook; the
# executor never writes into a stage's outputs (it hands over detached copies and backpropagates them).
warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")


def _structure(raw: fx.GraphModule, model, recompute: str | None, granularity: str):
    """The module the executor calls for ``raw``, and its layer units ("layer" only): lists of modules
    that FSDP shards together."""
    if granularity == "stage":
        return checkpointed(raw, model, recompute), []
    split, names = split_layers(raw, model)
    if recompute == "block":   # as checkpoint_blocks; the Checkpointed wrapper is the unit (torchtitan's order)
        for name in names:
            setattr(split, name, Checkpointed(getattr(split, name)))
    return (Checkpointed(split) if recompute == "stage" else split), _layer_units(split, names)


def _layer_units(split: torch.nn.Module, layers: list[str]) -> list[list[torch.nn.Module]]:
    """One unit per layer run, except where FSDP's rule (each parameter in exactly one unit) forbids:
    runs that read the same parameter share a unit, and a run holding a parameter that the split's root
    also reads (split_module keeps ``get_attr`` reads in the root and passes them in; tensor-parallel
    row biases are read that way) stays in the root's unit."""
    runs = [name for name, _ in split.named_children() if name.startswith("submod_")]
    group = {name: name for name in [*runs, ""]}        # "": the root's own attributes

    def find(name):
        while group[name] != name:
            name = group[name]
        return name
    owner: dict[int, str] = {}
    holders = [(name, split.get_submodule(name)) for name in runs]
    holders += [("", m) for name, m in split.named_children() if name not in runs]
    for name, module in holders:
        for p in module.parameters():
            if id(p) in owner and find(owner[id(p)]) != find(name):
                a, b = find(name), find(owner[id(p)])
                group[a if b == "" else b] = b if b == "" else a
            owner.setdefault(id(p), name)
    members: dict[str, list[str]] = {}
    for name in runs:
        if find(name) != "":
            members.setdefault(find(name), []).append(name)
    return [[split.get_submodule(n) for n in ms] for ms in members.values() if set(ms) & set(layers)]


def _named_tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]


def _repoint(raw: torch.nn.Module, root: torch.nn.Module, before: dict[str, int]) -> None:
    """Give ``raw`` the tensors that replaced its own in ``root``'s tree (``before``: name in root -> id
    of the tensor it held before): FSDP's sharded parameters, and the tensors a meta stage was
    allocated (``_allocate``), so ``raw.named_parameters()`` yields what the optimizer must step and
    ``raw`` holds no meta tensor; leaf modules shared by both trees already hold them."""
    new_by_old = {before[n]: t for n, t in _named_tensors(root)}
    for name, t in _named_tensors(raw):
        if id(t) in new_by_old and new_by_old[id(t)] is not t:
            owner, _, leaf = name.rpartition(".")
            setattr(raw.get_submodule(owner) if owner else raw, leaf, new_by_old[id(t)])


def _allocate(root: torch.nn.Module, device: torch.device) -> None:
    """Storage for the meta tensors of a sharded ``root``: FSDP's ``to_empty`` recipe (its ``_apply``
    re-registers each sharded parameter's local shard), so a sharded parameter gets only this rank's
    dim-0 chunk; unsharded ones (buffers, ``ignored_params``) get their whole local shape.  Tensors with
    values (a model only partly on the meta device) are left as they are."""
    root._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)


@torch.no_grad()
def _initialize(raw: torch.nn.Module, names: list[str], values: Callable) -> None:
    """Write the initial values of ``raw``'s tensors ``names`` (allocated, not yet set): each comes at its
    full (tp-local) shape from ``values`` (runtime/stage/params.py ``local_values``), one owner module at a
    time, and a sharded parameter keeps only its dp chunk (``copy_full_into``)."""
    tensors = dict(_named_tensors(raw))
    for name, value in values(names):
        copy_full_into(tensors[name], value)


@contextlib.contextmanager
def _fx_classes(modules: list[torch.nn.Module]):
    """Inside, the FSDP-wrapped GraphModules among ``modules`` (and below) are of their own classes.

    Setting a GraphModule's graph recompiles it and every GraphModule child (``_recompile_submodules``):
    fx writes ``forward``, ``__call__`` and ``_wrapped_call`` onto ``type(m)``.  ``fully_shard`` made that
    type a subclass ``FSDP<cls>(FSDPModule, cls)``, and the ``__call__`` fx installs there calls
    ``super().__call__`` -- ``cls``'s own fx ``__call__``, which looks up ``self._wrapped_call`` and finds
    the subclass's again: endless recursion (the RecursionError of a re-plan).  Recompiled on ``cls``,
    the FSDP subclass inherits the new ``forward`` and ``__call__``; FSDP's state and hooks live on the
    instance, not the class, so the swap does not touch them."""
    swapped = [(m, type(m)) for root in modules for m in root.modules()
               if isinstance(m, FSDPModule) and isinstance(m, fx.GraphModule)]
    for m, wrapped in swapped:
        m.__class__ = next(c for c in wrapped.__bases__ if not issubclass(c, FSDPModule))
    try:
        yield
    finally:
        for m, wrapped in swapped:
            m.__class__ = wrapped


class StageSharding:
    """Builds and keeps this rank's FSDP-sharded stage modules; ``grads`` steps their gradient sync."""

    def __init__(self, world, model, granularity: str, recompute: str | None, autocast: torch.dtype | None):
        if granularity not in GRANULARITIES:
            raise AutosplitError(f"dp_shard granularity {granularity!r}: expected one of {GRANULARITIES}")
        self.world, self.model, self.granularity, self.recompute = world, model, granularity, recompute
        # AMP: parameters stay float32 (the sharded master copy); FSDP all-gathers them in the autocast
        # dtype and reduces gradients in float32.  torch.autocast still decides each op's dtype, so the
        # run matches the plan's dtypes (autocast_prop.py).
        self.mp = MixedPrecisionPolicy(param_dtype=autocast, reduce_dtype=torch.float32 if autocast else None)
        self.raw: list[fx.GraphModule] = []
        self.called: list[torch.nn.Module] = []
        self.grads: ShardedGrads | None = None
        self.parts: list[torch.nn.Parameter] = []      # cp: multiplied by cp after the reduce-scatter (*cp*)

    def stages(self, modules: list[fx.GraphModule], stages: list[int], ignored_names: set[str],
               values: Callable | None = None, whole_names: set[str] = frozenset()):
        """(raw, called) modules for this rank's stages.  A re-plan (same cut, new microbatch shape)
        keeps the sharded modules, whose parameters the optimizer holds, and takes the new graphs.

        Args:
            modules: this rank's stage modules (tp shards); a meta model's still on the meta device.
            stages: their stage indices.
            ignored_names: parameters FSDP leaves out (see *replicated*).
            values: a meta model's ``local_values`` (runtime/stage/params.py): its tensors are sharded on the
                meta device, then only this rank's shards are allocated and set (*meta* above).
            whole_names: with a cp axis, the parameters whose gradient is whole on each cp rank (*cp*).
        """
        if self.raw:
            for old, new in zip(self.raw, modules):
                self._transplant(old, new)
            return self.raw, self.called
        for raw in modules:
            raw = copy.deepcopy(raw)                     # "own copy" (module docstring); of a meta stage: free
            meta = [n for n, t in [*raw.named_parameters(), *raw.named_buffers()] if t.is_meta]
            root, units = _structure(raw, self.model, self.recompute, self.granularity)
            before = {n: id(t) for n, t in _named_tensors(root)}
            ignored = {p for n, p in raw.named_parameters() if n in ignored_names}
            # "layer": the layer units reshard after forward (ZeRO-3); the stage root and "stage" units
            # keep their parameters through the step (see "kept").  Inner units first, as FSDP requires.
            mesh = self.world.grad_mesh if self.world.mesh.cp > 1 else self.world.device_mesh["dp"]
            for unit in units:
                fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh,
                            reshard_after_forward=True, mp_policy=self.mp, ignored_params=ignored)
            fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=self.mp, ignored_params=ignored)
            if meta:                  # after sharding: only this rank's chunks are ever allocated
                _allocate(root, self.world.device)
            _repoint(raw, root, before)
            if meta:                  # by the model's names, which ``raw`` holds the allocated tensors under now
                _initialize(raw, meta, values)
            self.raw.append(raw)
            self.called.append(root)
            self.parts += [p for n, p in raw.named_parameters() if n not in whole_names and n not in ignored_names]
        self.grads = ShardedGrads(dict(zip(stages, self.called)), keep=self.granularity == "stage",
                                  parts=self.parts, cp=self.world.mesh.cp)
        return self.raw, self.called

    def _transplant(self, old: fx.GraphModule, new: fx.GraphModule) -> None:
        """Put ``new``'s graphs (same nodes and parameters, other shapes) into the sharded ``old``."""
        root = self.called[self.raw.index(old)]
        fresh, _ = _structure(new, self.model, self.recompute, self.granularity)
        with _fx_classes([old, root]):
            old.graph = copy.deepcopy(new.graph)
            for name, mod in root.named_modules():
                if isinstance(mod, fx.GraphModule) and mod is not old:
                    mod.graph = copy.deepcopy(fresh.get_submodule(name).graph)

    def reshard(self) -> None:
        """Free the unsharded parameters a forward-only pass left gathered (kept units)."""
        for root in self.called:
            for m in root.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()


def release_plan_values(plan, model: torch.nn.Module) -> int:
    """Drop the plan's own copies of stage values once ``StageSharding`` holds this rank's shards
    (issue 50 item 8: under ``dp_shard`` a model not built on meta kept whole stages beside its shards).

    What held them: ``plan.modules`` (every stage at tp rank 0: with tp > 1 each split parameter is a
    new tensor, rank 0's slice), ``plan._tp_modules`` (a tp rank's stage modules, built on demand), the
    tensor-parallel plan's cache of what its makers built per tp rank (``tp_plan._cache``), and the
    stage graphs: a tp rank's module is built on its stage's graph, and fx makes the graph name it
    ``owning_module`` (a strong reference that outlives the cache).

    The caches are emptied (a later ``plan.stage_modules`` builds them again, from the user's model)
    and each graph is owned by its ``plan.modules`` entry again.  ``plan.modules`` stays, for its
    names, shapes and graphs (the state dict's owners, dumps, agreement), with each tensor that is not
    the user's own replaced by a meta tensor of its shape and dtype.  The user's model, and the tensors
    the plan shares with it (every tensor at tp = 1, the replicated ones with tp > 1), are the user's
    and are not touched.  Returns the bytes of the storages the plan no longer references."""
    user_ids = {id(t) for t in [*model.parameters(), *model.buffers()]}
    user_ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    user_ptrs.discard(0)
    tp_plan = plan.tp_plan
    if tp_plan is not None and isinstance(getattr(tp_plan, "_cache", None), dict):
        tp_plan._cache.clear()
    plan._tp_modules.clear()
    for root in plan.modules:     # a tp rank's stage module shares its graph, which then names it as owner
        root.graph.owning_module = root
    memo: dict[int, torch.Tensor] = {}
    released: dict[int, int] = {}
    for root in plan.modules:
        for module in root.modules():
            for table in (module._parameters, module._buffers):
                for name, t in table.items():
                    if t is None or t.is_meta or id(t) in user_ids:
                        continue
                    storage = t.untyped_storage()
                    if storage.data_ptr() in user_ptrs:       # a view of the user's tensor
                        continue
                    if id(t) not in memo:
                        meta = torch.empty_like(t, device="meta")
                        memo[id(t)] = (torch.nn.Parameter(meta, requires_grad=t.requires_grad)
                                       if isinstance(t, torch.nn.Parameter) else meta)
                        released[storage.data_ptr()] = storage.nbytes()
                    table[name] = memo[id(t)]
    return sum(released.values())


class ShardedGrads:
    """The dp gradient sync of sharded stages, with GradBuckets' interface (data_parallel.py):
    ``arm(stage)`` before a stage's last backward of the step, ``finish()`` after the schedule,
    ``enabled`` False under ``no_sync``."""

    def __init__(self, roots: dict[int, torch.nn.Module], keep: bool, parts=(), cp: int = 1):
        self.roots, self.keep = roots, keep
        self.parts, self.cp = list(parts), cp
        self.enabled = True
        self.launched_early = 0
        self._begin()

    def _begin(self) -> None:
        """Until a stage is armed its backwards only accumulate unsharded gradients (no collective)."""
        for root in self.roots.values():
            root.set_requires_gradient_sync(False)
            root.set_is_last_backward(False)
            root.set_reshard_after_backward(not self.keep)

    def arm(self, stage: int) -> None:
        # This backward is the stage's last of the step on every rank of the dp group (they run the same
        # schedule), so the reduce-scatters it issues come in the same order everywhere.
        root = self.roots[stage]
        root.set_is_last_backward(True)
        root.set_reshard_after_backward(True)
        root.set_requires_gradient_sync(self.enabled)
        self.launched_early += self.enabled

    def finish(self) -> None:
        """FSDP waited for its reduce-scatters in the last backward's callback; reset for the next step."""
        if self.enabled and self.cp > 1:      # averaged over dp * cp: the cp parts' sum wanted (*cp*)
            with torch.no_grad():
                for p in self.parts:
                    if p.grad is not None:
                        local_part(p.grad).mul_(self.cp)
        self.launched_early = 0
        self._begin()


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor, the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def full_value(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a sharded one all-gathered over dp (a collective: every rank of the dp group
    calls it for the same tensors in the same order), others as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def copy_full_into(dst: torch.Tensor, value: torch.Tensor) -> None:
    """Copy a full-shape ``value`` into ``dst``; into a sharded ``dst`` only this rank's dim-0 chunk
    (FSDP2 shards as ``torch.chunk`` does)."""
    if not isinstance(dst, DTensor):
        dst.copy_(value)
        return
    local = dst.to_local()
    if local.numel():
        start = sum(c.shape[0] for c in value.chunk(dst.device_mesh.size(), dim=0)[:dst.device_mesh.get_local_rank()])
        local.copy_(value.narrow(0, start, local.shape[0]))


def grad_square(g: torch.Tensor, count_replicated: bool) -> torch.Tensor:
    """Sum of squares of this rank's part of gradient ``g``, float64: a dp shard counts on every rank
    (the shards sum over dp), a replicated gradient only where ``count_replicated`` (one dp rank)."""
    if isinstance(g, DTensor):
        return g.to_local().detach().double().square().sum()
    return g.detach().double().square().sum() if count_replicated else g.new_zeros((), dtype=torch.float64)


def unsharded_params(module: torch.nn.Module) -> list[torch.Tensor]:
    """The unsharded parameters FSDP2 keeps for the units under ``module`` (gradients accumulate on
    them between reduce-scatters).  Private FSDP2 state (``_get_fsdp_state``): where this torch keeps it
    elsewhere, none are found and the caller checks only ``module.parameters()``."""
    found = []
    for m in module.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            p = getattr(fsdp_param, "_unsharded_param", None)
            if p is not None:
                found.append(p)
    return found
