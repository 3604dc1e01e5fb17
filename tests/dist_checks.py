"""Functions run on every rank of a test pool (see dist_pool.py); each returns plain data to assert on."""
from __future__ import annotations

import contextlib
import copy
import logging

import torch
import torch.distributed as dist

import autosplit
from autosplit.mesh import MeshShape
from tests.models import VARIANTS


def batches(steps: int, batch: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, batch, 3, 32, 32, generator=g)
    ys = torch.randint(0, 7, (steps, batch), generator=g)
    return xs, ys


def max_diff(a: dict, b: dict) -> float:
    """Largest elementwise difference between two state dicts with the same keys."""
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


def train_steps(pm, opt, xs, ys, rows) -> list[float]:
    """One ``pm.step`` on this replica's ``rows`` of each batch, each followed by an optimizer step: the losses."""
    losses = []
    for x, y in zip(xs, ys):
        losses.append(pm.step(x[rows], y[rows]))
        opt.step()
        opt.zero_grad()
    return losses


def train_accumulating(pm, ref, xs, ys, rows, micro_steps: int, updates: int, lr: float) -> None:
    """``updates`` SGD steps of ``pm`` and of the single-device ``ref``, each accumulating ``micro_steps``
    calls of ``pm.step`` (all but the last under ``no_sync``) on this replica's ``rows`` of the batches."""
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    for u in range(updates):
        for k in range(micro_steps):
            i = u * micro_steps + k
            if k < micro_steps - 1:
                with pm.no_sync():
                    pm.step(xs[i][rows], ys[i][rows])
            else:
                pm.step(xs[i][rows], ys[i][rows])
            torch.nn.functional.cross_entropy(ref(xs[i]), ys[i]).backward()
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()


def reference_training(model, xs, ys, lr):
    model = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def train_matches_single_device(name: str, mesh, schedule: str, chunks: int, microbatches: int = 4,
                                batch: int = 8, steps: int = 3, lr: float = 0.1, lazy: bool = False, **kw):
    """Losses and full_state_dict after `steps` SGD steps vs single-device training (max abs diffs)."""
    torch.manual_seed(0)
    model = VARIANTS[name]()
    xs, ys = batches(steps, batch)
    ref_losses, ref_state = reference_training(model, xs, ys, lr)
    dp = MeshShape.parse(mesh, world_size=dist.get_world_size()).dp      # a tuple, or a mapping with cp
    example = None if lazy else xs[0, : batch // dp // microbatches]
    pm = autosplit.parallelize(model, mesh=mesh, loss_fn=torch.nn.CrossEntropyLoss(),
                               num_microbatches=microbatches, schedule=schedule, chunks_per_rank=chunks,
                               example_input=example, **kw)
    opt = torch.optim.SGD(pm.parameters(), lr=lr)
    rows = batch // pm.dp_size
    losses = []
    for x, y in zip(xs, ys):
        sl = slice(pm.dp_rank * rows, (pm.dp_rank + 1) * rows)
        losses.append(pm.step(x[sl], y[sl]))
        opt.step()
        opt.zero_grad()
    state = pm.full_state_dict()
    assert set(state) == set(ref_state)
    param_diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    tp = pm.plan.tp_plan
    return {"loss_diff": loss_diff, "param_diff": param_diff, "losses": losses,
            "tp_axes": [a for a, _ in tp.axes] if tp is not None else [],
            "cp": (pm.cp_rank, pm.cp_size), "tp": (pm.tp_rank, pm.tp_size)}


def error_of(fn, *args):
    """Run fn and return the error it raised as 'Type: message' (None if it did not raise)."""
    try:
        fn(*args)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _small(mesh=(2, 1, 1), microbatches=2, **kw):
    torch.manual_seed(0)
    model = VARIANTS["timm_cls"]()
    return autosplit.parallelize(model, mesh=mesh, num_microbatches=microbatches, **kw)


def bad_inputs():
    """Each bad input must raise the same clear error on every rank, without communicating."""
    out = {"mesh": error_of(_small, (2, 1, 2))}
    pm = _small(example_input=torch.randn(2, 3, 32, 32))
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    out["indivisible"] = error_of(pm.step, torch.randn(5, 3, 32, 32), torch.randint(0, 10, (5,)))
    out["shape"] = error_of(pm.step, torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,)))
    out["dtype"] = error_of(pm.step, x.double(), y)
    out["ok_after"] = pm.step(x, y)         # the bad calls left the module usable
    return out


def failing_rank():
    """Rank 1's loss raises at its third microbatch; every rank must stop with that cause."""
    import time
    calls = []

    def loss_fn(out, y):
        calls.append(1)
        if dist.get_rank() == 1 and len(calls) == 3:
            raise ValueError("injected failure")
        return torch.nn.functional.cross_entropy(out, y)

    pm = _small(microbatches=4, loss_fn=loss_fn, example_input=torch.randn(1, 3, 32, 32), timeout_s=30)
    start = time.monotonic()
    try:
        pm.step(torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,)))
        err, notes = None, []
    except Exception as exc:
        err, notes = f"{type(exc).__name__}: {exc}", getattr(exc, "__notes__", [])
    return {"error": err, "notes": notes, "seconds": time.monotonic() - start}


def lazy_plan_then_train(name="timm_cls", mesh=(2, 1, 1)):
    """example_input=None: parameters() before the first step plans from the model's input size."""
    return train_matches_single_device(name, mesh, "1f1b", 1, lazy=True)


def _setup(mesh=(2, 1, 2), microbatches=2, batch=8, seed=0, **kw):
    torch.manual_seed(seed)
    model = VARIANTS["timm_cls"]()
    ref = copy.deepcopy(model)
    dp = MeshShape.parse(mesh, world_size=dist.get_world_size()).dp
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=microbatches,
                               example_input=torch.randn(batch // dp // microbatches, 3, 32, 32), **kw)
    xs, ys = batches(3, batch)
    rows = slice(pm.dp_rank * batch // dp, (pm.dp_rank + 1) * batch // dp)
    return pm, ref, xs, ys, rows


def _state_diff(pm, ref) -> float:
    state, ref_state = pm.full_state_dict(), ref.state_dict()
    return max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)


def features(mesh=(2, 1, 2), **kw):
    """predict, clip_grad_norm_, no_sync accumulation, checkpointing, load_full_state_dict."""
    out = {}
    # predict: the replica's logits on every rank of the replica
    pm, ref, xs, ys, rows = _setup(mesh, **kw)
    out["predict"] = (pm.predict(xs[0][rows]) - ref(xs[0][rows])).abs().max().item()
    out["modes"] = [all(not m.training for m in pm.eval().raw_modules), all(m.training for m in pm.train().raw_modules)]
    # clip_grad_norm_ over the global gradient (pp and dp), then SGD
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    pm.step(xs[0][rows], ys[0][rows])
    norm = pm.clip_grad_norm_(0.05)
    opt.step()
    torch.nn.functional.cross_entropy(ref(xs[0]), ys[0]).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05).item()
    ref_opt.step()
    out["clip_norm"] = abs(norm - ref_norm)
    out["clip_params"] = _state_diff(pm, ref)
    # gradient accumulation: two steps, the first without the dp all-reduce
    opt.zero_grad()
    ref_opt.zero_grad()
    with pm.no_sync():
        pm.step(xs[1][rows], ys[1][rows])
    pm.step(xs[2][rows], ys[2][rows])
    opt.step()
    for i in (1, 2):
        torch.nn.functional.cross_entropy(ref(xs[i]), ys[i]).backward()
    ref_opt.step()
    out["accumulate"] = _state_diff(pm, ref)
    # load_full_state_dict: every rank ends with the loaded weights
    torch.manual_seed(123)
    other = VARIANTS["timm_cls"]().state_dict()
    pm.load_full_state_dict(other)
    out["load"] = max((pm.full_state_dict()[k] - other[k]).abs().max().item() for k in other)
    out["load_error"] = error_of(pm.load_full_state_dict, {"nope": torch.zeros(1)})
    # activation checkpointing of stages gives the same training
    out["checkpoint"] = train_with(mesh, recompute="stage", **kw)
    out["checkpoint_blocks"] = train_with(mesh, recompute="block", **kw)
    return out


def train_with(mesh=(2, 1, 2), **kw) -> float:
    pm, ref, xs, ys, rows = _setup(mesh, **kw)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in zip(xs, ys):
        pm.step(x[rows], y[rows])
        opt.step()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return _state_diff(pm, ref)


def mixed_precision():
    out = {"bf16": train_with(autocast=torch.bfloat16)}
    # fp16: an overflow anywhere makes every rank skip the step and halve the scale
    pm, ref, xs, ys, rows = _setup(autocast=torch.float16)
    before = pm.scaler.scale
    pm.loss_fn = lambda out, y: torch.nn.functional.cross_entropy(out, y) * float("inf")
    pm.executor.loss_fn = pm.loss_fn
    pm.step(xs[0][rows], ys[0][rows])
    out["skipped"] = pm.scaler.skipped
    out["grads_none"] = all(p.grad is None for p in pm.parameters())
    out["scale_halved"] = pm.scaler.scale == before / 2
    return out


def count_tp_collectives(name: str, microbatches: int = 2, **kw):
    """Collectives per transformer block and microbatch, forward and backward, in one training step."""
    from autosplit.runtime.parallel.tp_collectives import COUNTS
    torch.manual_seed(0)
    model = VARIANTS[name]()
    depth = len([m for m in model.modules() if type(m).__name__ in ("Block", "EncoderBlock", "HandBlock")])
    pm = autosplit.parallelize(model, mesh=(1, dist.get_world_size(), 1), num_microbatches=microbatches,
                               example_input=torch.randn(2, 3, 32, 32), **kw)
    x, y = batches(1, 2 * microbatches)
    COUNTS.clear()
    from autosplit.runtime.parallel import tp_collectives as collectives
    reduced = []                     # (tensor given to the all-reduce, tensor reduced) per call
    original = collectives.dist.all_reduce
    collectives.dist.all_reduce = lambda t, *a, **k: reduced.append(t) or original(t, *a, **k)
    clones = []
    clone = torch.Tensor.clone
    torch.Tensor.clone = lambda self, *a, **k: clones.append(1) or clone(self, *a, **k)
    try:
        pm.step(x[0], y[0])
    finally:
        collectives.dist.all_reduce, torch.Tensor.clone = original, clone
    per_block = {f"{k[0]}:{k[1]}": v / (depth * microbatches) for k, v in COUNTS.items()}
    return {"per_block": per_block, "regions": sum(1 for line in pm.plan.tp_plan.regions if ": row," in line or ": by heads" in line), "depth": depth,
            "microbatches": microbatches, "all_reduces": len(reduced), "clones": len(clones)}




def bucket_overlap():
    """Small buckets: most are all-reduced while the last backward still runs, not at the end."""
    pm, ref, xs, ys, rows = _setup(mesh=(1, 1, 2), bucket_mb=0.01)
    pm.step(xs[0][rows], ys[0][rows])
    out = {"buckets": len(pm.buckets.buckets), "early": pm.buckets.launched_early}

    def in_buckets() -> bool:     # every .grad is a view of its bucket's flat buffer
        return all(p.grad.untyped_storage().data_ptr() == b.flat.untyped_storage().data_ptr()
                   for b in pm.buckets.buckets for p in b.params)
    out["views"] = in_buckets()
    # with .grad kept (zero_grad(set_to_none=False)) backward accumulates into the buckets: no copy
    for p in pm.parameters():
        p.grad.zero_()
    copies = []
    original = torch.Tensor.copy_
    torch.Tensor.copy_ = lambda self, *a, **k: copies.append(self.shape) or original(self, *a, **k)
    try:
        pm.step(xs[1][rows], ys[1][rows])
    finally:
        torch.Tensor.copy_ = original
    out["views_again"], out["copies"] = in_buckets(), len(copies)
    return out


def hanging_rank():
    """Rank 1 stalls in its loss for longer than the timeout: rank 0 gives up naming itself and the wait."""
    import time
    def loss_fn(out, y):
        if dist.get_rank() == 1:
            time.sleep(6)
        return torch.nn.functional.cross_entropy(out, y)
    # a fixed cost profile: measuring this CPU (rank 0, while rank 1 waits) can itself take longer than
    # 2 s on a loaded machine, and this test is about the stall in the loss, not about planning
    pm = _small(microbatches=2, loss_fn=loss_fn, example_input=torch.randn(1, 3, 32, 32), timeout_s=2,
                device="h100")
    # the ranks finish parallelize up to seconds apart on a loaded machine: start the step together, so
    # that the 2 s run out in the loss, not in the step's plan agreement (seen once in a full suite run)
    dist.barrier()
    start = time.monotonic()
    err = error_of(pm.step, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))
    return {"error": err, "seconds": time.monotonic() - start}


def replay_early_post_order(timeout_s: float = 3.0):
    """The executor's old posting order (receives posted early as groups of their own), run once on
    plain gloo, which forgives it, then on the strict transport, which must hang like NCCL and end
    every rank with the timeout message."""
    from tests.schedule_orders import early_post_order
    return replay_order(early_post_order, timeout_s)


def replay_order(reorder, timeout_s: float):
    """1F1B on two ranks in the order ``reorder(schedule)`` gives, run once on plain gloo, then on the
    strict transport: {"gloo": error or None, "strict": error or None, "seconds": the strict run's}."""
    import time
    from autosplit.runtime.pipeline.p2p import GlooTransport, StrictTransport
    from autosplit.schedule import build_schedule
    pm = _small(mesh=(2, 1, 1), microbatches=2, example_input=torch.randn(1, 3, 32, 32), timeout_s=timeout_s)
    pm.executor.train_items = reorder(build_schedule("1f1b", 2, 2))[pm.pp_rank]
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    pm.executor.transport = GlooTransport(pm.world.group("pp"))
    out = {"gloo": error_of(pm.step, x, y)}
    pm.executor.transport = StrictTransport(pm.world.group("pp"))
    start = time.monotonic()
    out["strict"] = error_of(pm.step, x, y)
    out["seconds"] = time.monotonic() - start
    return out


def dying_rank(victim: int, stamp_path: str):
    """Rank ``victim`` exits abruptly inside its third loss; the others must name it (or, when it hosted
    the store, say that the store's host died).  The victim writes when it died to ``stamp_path``."""
    import os
    import time
    calls = []

    def loss_fn(out, y):
        calls.append(1)
        if dist.get_rank() == victim and len(calls) == 1 and victim == 1:
            with open(stamp_path, "w") as f:
                f.write(str(time.time()))
            os._exit(1)
        return torch.nn.functional.cross_entropy(out, y)

    pm = _small(microbatches=2, loss_fn=loss_fn, example_input=torch.randn(1, 3, 32, 32), timeout_s=30)
    if dist.get_rank() == victim and victim != 1:        # not the last stage: die before sending
        with open(stamp_path, "w") as f:
            f.write(str(time.time()))
        os._exit(1)
    err = error_of(pm.step, torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,)))
    return {"error": err, "ended": time.time()}


@contextlib.contextmanager
def logged(records: list):
    """Inside, the messages of ``logging.getLogger("autosplit")`` (INFO and up) go into ``records``."""
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("autosplit")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield logger
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)


def logged_summary() -> list[str]:
    """What the library logs to ``logging.getLogger("autosplit")`` while planning (it prints nothing)."""
    records = []
    with logged(records) as logger:
        pm = _small(mesh=(2, 1, 1))
        list(pm.parameters())                           # plans (from the model's declared input size)
        logger.setLevel(logging.DEBUG)
        x, y = batches(1, 4)
        pm.step(x[0], y[0])                             # DEBUG: every action and transfer group
    return records


def _thread_names() -> tuple:
    import os
    from collections import Counter
    names = Counter()
    for t in os.listdir("/proc/self/task"):
        try:
            names[open(f"/proc/self/task/{t}/comm").read().strip()] += 1
        except FileNotFoundError:        # a thread that just ended
            pass
    return tuple(sorted(names.items()))


def _process_resources() -> tuple[int, tuple]:
    """(process groups this rank belongs to besides the default one, the process's OS threads by name),
    once the threads stopped changing (a closed group's threads end shortly after it)."""
    import gc
    import time
    gc.collect()
    groups = len([g for g in dist.distributed_c10d._world.pg_map if g is not dist.group.WORLD])
    names = _thread_names()
    for _ in range(20):
        time.sleep(0.05)
        names, last = _thread_names(), names
        if names == last:
            break
    return groups, names


def dropped_releases(configs: list[tuple[tuple, dict]], checkpoint_dir: str) -> dict:
    """Build and step one ParallelModule per (mesh, options), save a checkpoint (its own group), then drop
    it without close(); and one parallelize that raises after the world is built (a bad loss_fn).  The
    process's groups and threads before, while the dropped ones are held, and after release_orphans; the
    bucket hooks left on the models' parameters."""
    from autosplit import AutosplitError
    from autosplit.runtime.parallel_module import release_orphans
    xs, ys = batches(1, 8)
    with autosplit.parallelize(VARIANTS["tp_timm"](), mesh=configs[0][0], num_microbatches=2) as pm:
        pm.step(xs[0][: 8 // pm.dp_size], ys[0][: 8 // pm.dp_size])       # once per process: profile, heartbeat
    before = _process_resources()
    models = []
    for mesh, kw in configs:
        torch.manual_seed(0)
        models.append(VARIANTS["tp_timm"]())
        pm = autosplit.parallelize(models[-1], mesh=mesh, num_microbatches=2, **kw)
        rows = slice(pm.dp_rank * 8 // pm.dp_size, (pm.dp_rank + 1) * 8 // pm.dp_size)
        pm.step(xs[0][rows], ys[0][rows])
        pm.save_checkpoint(checkpoint_dir)
        del pm                                              # dropped, never closed
    try:
        autosplit.parallelize(VARIANTS["tp_timm"](), mesh=configs[0][0], loss_fn=42)
        raised = None
    except AutosplitError as exc:
        raised = str(exc)
    held = _process_resources()
    released = release_orphans()
    hooks = sum(len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) for m in models for p in m.parameters())
    return {"before": before, "held": held, "released": released, "after": _process_resources(),
            "raised": raised, "hooks": hooks}


def close_releases(configs: list[tuple[tuple, dict]], checkpoint_dir: str | None = None) -> dict:
    """Build, step and close one ParallelModule per (mesh, options); the process's groups and threads
    before (after a first module built and closed: the profile measurement and the heartbeat thread
    are once per process), while open and after each close; and what calls on a closed module say."""
    from autosplit import AutosplitError
    xs, ys = batches(1, 8)

    def build_step_close(mesh, kw, save: bool):
        torch.manual_seed(0)
        with autosplit.parallelize(VARIANTS["tp_timm"](), mesh=mesh, num_microbatches=2, **kw) as pm:
            rows = slice(pm.dp_rank * 8 // pm.dp_size, (pm.dp_rank + 1) * 8 // pm.dp_size)
            pm.step(xs[0][rows], ys[0][rows])
            if save:
                pm.save_checkpoint(checkpoint_dir)       # builds the checkpoint's own group
            opened = _process_resources()
        pm.close()                                         # a second close does nothing
        return pm, opened

    build_step_close(*configs[0], save=False)
    before = _process_resources()
    opened, after, errors = [], [], {}
    for mesh, kw in configs:
        pm, now = build_step_close(mesh, kw, save=checkpoint_dir is not None)
        opened.append(now)
        after.append(_process_resources())       # with ``pm`` still referenced
    for call, fn in (("step", lambda: pm.step(xs[0], ys[0])), ("parameters", lambda: list(pm.parameters())),
                     ("full_state_dict", pm.full_state_dict)):
        try:
            fn()
        except AutosplitError as exc:
            errors[call] = str(exc)
    return {"before": before, "opened": opened, "after": after, "errors": errors}
