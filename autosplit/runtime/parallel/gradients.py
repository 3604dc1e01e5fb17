"""Step-level gradient and loss reductions of a ParallelModule: partial gradients, the mean loss, the norm.

Terms:
  partial gradient -- a replicated parameter each tp rank saw only part of (a qk-norm weight inside a
                      1D region, layer norms under sequence parallelism): its gradient is summed over
                      tp once per step, outside the dp buckets.
  first copy       -- the lowest tp rank holding a slice of a parameter (autosplit/tp/shards.py); a
                      norm counts each element once, however many ranks hold it.
Ordering (NCCL's rule): every rank of a group issues these collectives in the same order: the
partial-gradient sum over tp, then its dp average; the norm over dp (when dp-sharded), pp, tp.
Every wait goes through the Watchdog.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.profiler import record_function

from autosplit.runtime.parallel.fsdp import grad_square
from autosplit.runtime.parallel.tp_collectives import reduce_grad


def reduce_partial_grads(params: list, earlier: list, world, watchdog, dp_sync: bool) -> None:
    """Sum the partial gradients over tp, add back what earlier steps of a gradient accumulation had
    already summed, and on a synchronising step (not under ``no_sync``) average the whole accumulated
    gradient over dp.  They are not in the dp buckets: a bucket would average only this step's part,
    and the parts that ``no_sync`` steps accumulated would never be averaged over dp."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = reduce_grad(torch.cat([g.reshape(-1) for g in grads]), "tp")
    offset = 0
    for p, before in zip(params, earlier):
        n = p.numel()
        part = flat[offset:offset + n].view_as(p)
        flat[offset:offset + n] = (part + before if before is not None else part).reshape(-1)
        offset += n
    if dp_sync:
        with record_function("autosplit::dp all_reduce of partial gradients"):   # pm.trace_step's lanes
            work = dist.all_reduce(flat, group=world.group("dp"), async_op=True)
            watchdog.wait(work, "data-parallel all-reduce of partial gradients")
        flat.div_(world.mesh.dp)
    offset = 0
    for p in params:                    # views of the reduced buffer, as the dp buckets' are
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p)
        offset += n


def global_mean(loss_sum: torch.Tensor, overflow: torch.Tensor | None, num_microbatches: int, world,
                watchdog) -> tuple[float, bool]:
    """The global batch's mean loss and whether any rank's gradients overflowed: an all-reduce over
    each mesh axis larger than 1 (tp, dp, pp; see below) and the step's one host sync (``tolist``)."""
    flag = overflow.reshape(1) if overflow is not None else torch.zeros(1, device=world.device)
    total = torch.cat([loss_sum.reshape(1).to(world.device, torch.float64) / num_microbatches,
                       flag.to(torch.float64)])
    watchdog.at("loss all-reduce")
    # Over the mesh's own axis groups, one after another, and not on the default group: the default
    # group is the user's, which a failure never aborts and whose NCCL timeout is not ours; a sum over
    # tp, then dp, then pp is the sum over the world, each on a group this module owns, in the same
    # order on every rank (NCCL's rule).  Why not one more group spanning the world: on NCCL that
    # is one more communicator (its buffers on every GPU) for two numbers a step.
    sizes = {"tp": world.mesh.block, "dp": world.mesh.dp, "pp": world.mesh.pp}    # "tp": the cp x tp block
    axes = [axis for axis in ("tp", "dp", "pp") if sizes[axis] > 1]
    with record_function("autosplit::loss all_reduce"):          # pm.trace_step's communication lane
        for k, axis in enumerate(axes):
            work = dist.all_reduce(total, group=world.group(axis), async_op=True)
            # host: the last one is read on the host next (NCCL: check every deferred work first)
            watchdog.wait(work, f"loss all-reduce over {axis}", host=k == len(axes) - 1)
    if not axes:            # one rank: still check every deferred NCCL work before the host read
        watchdog.settle()
    loss, overflowed = total.tolist()
    return loss / (world.mesh.block * world.mesh.dp), overflowed > 0


def clip_grad_norm(named_params: list, sharded: dict, max_norm: float, world, watchdog, *,
                   dp_sharded: bool) -> float:
    """Scale every gradient by max_norm / norm when the global norm exceeds max_norm; returns the norm."""
    tp_rank, dp_rank = world.coord.tp, world.coord.dp
    # with cp under dp_shard, FSDP shards over dp x cp: every cp rank holds its own shard, so each counts
    # as the block position of its tp coordinate at cp 0 does, and the sums run over dp x cp, then the
    # tp axis alone (the block's cp ranks hold the same sum by then)
    cp_shards = dp_sharded and world.mesh.cp > 1
    first_dp = dp_rank == 0 and (not cp_shards or world.mesh.cp_of(tp_rank) == 0)
    if cp_shards:
        tp_rank = world.mesh.tp_of(tp_rank)
    grads, local = [], torch.zeros(1, dtype=torch.float64, device=world.device)
    for name, p in named_params:
        if p.grad is None:
            continue
        grads.append(p.grad)
        if sharded[name].first_copy(tp_rank) if name in sharded else tp_rank == 0:
            local += grad_square(p.grad, count_replicated=not dp_sharded or first_dp)
    # dp first when sharded (each rank holds a shard of most gradients); every rank runs these in this order
    if cp_shards:
        axes = ("dp_cp", "pp", *(("tp_1d",) if world.mesh.tp > 1 else ()))
    else:
        axes = ("dp", "pp", "tp") if dp_sharded else ("pp", "tp")
    for axis in axes:
        work = dist.all_reduce(local, group=world.group(axis), async_op=True)
        watchdog.wait(work, f"gradient-norm all-reduce over {axis}", host=True)
    norm = math.sqrt(local.item())
    coef = max_norm / (norm + 1e-6)
    if coef < 1:
        for g in grads:
            g.mul_(coef)
    return norm


def begin_step(partial_params: list) -> list:
    """Before a step's backward: take the partial gradients aside (already reduced by earlier steps of a
    gradient accumulation), so this step's backward starts them from zero.  Returns what was taken."""
    earlier = [p.grad for p in partial_params]
    for p in partial_params:
        p.grad = None
    return earlier


def finish_step(program, scaler, loss_sum: torch.Tensor, earlier: list, num_microbatches: int) -> float:
    """After a step's backward, in this order on every rank (NCCL's rule, see the module docstring):
    the dp buckets' last reductions, the partial gradients (tp sum, dp average), the buffers' dp
    broadcast, the loss scaler's unscale, the loss and overflow all-reduce, the scaler's update.

    Args:
        program: the RankPlanner (runtime/rank_plan.py) that ran the step: buckets, partial params,
            modules, world, watchdog.
        scaler: the LossScaler (runtime/state/loss_scaler.py); disabled unless autocast is float16.
        loss_sum: the sum of this rank's microbatch losses (a tensor; 0 off the last stage).
        earlier: ``begin_step``'s result.
        num_microbatches: per step.
    Returns the global batch's mean loss, the same on every rank.
    """
    world, watchdog = program.world, program.watchdog
    # each phase announced (``watchdog.at``): the caller runs this inside ``watchdog.guarded``, which
    # names the phase an exception came from in the failure every rank learns
    if program.buckets is not None:
        watchdog.at("data-parallel gradient buckets")
        program.buckets.finish()
    dp_sync = program.buckets is not None and program.buckets.enabled   # not inside no_sync
    watchdog.at("partial-gradient reduction")
    reduce_partial_grads(program.partial_params, earlier, world, watchdog, dp_sync)
    watchdog.at("buffer broadcast over dp")
    program.sync_buffers()
    params, overflow = [], None
    if scaler.enabled:
        watchdog.at("loss scaler unscale")
        params = [p for m in program.raw_modules for p in m.parameters()]
        overflow = scaler.unscale(params, world.device)
    loss, overflow_anywhere = global_mean(loss_sum, overflow, num_microbatches, world, watchdog)
    if scaler.enabled:
        watchdog.at("loss scaler update")
        scaler.update(overflow_anywhere, params)
    return loss
