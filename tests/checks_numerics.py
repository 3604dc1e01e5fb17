"""Functions run on every rank of a test pool (see dist_pool.py) for the numerics checks of
tests/test_numerics.py: gradient accumulation under tp x dp, train/eval mode, dropout under tp,
fp16 loss scaling, buffers under dp.  Each returns plain data to assert on."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autosplit
from autosplit.runtime.faults import call_gate
from tests.dist_checks import batches, max_diff, train_accumulating, train_steps
from tests.models import VARIANTS


# ---- item 1: no_sync accumulation with tp > 1 and dp > 1 -----------------------------------------
def accumulate_tp_dp(name: str, mesh=(1, 2, 2), micro_steps: int = 3, updates: int = 2, batch: int = 8,
                     lr: float = 0.5, **kw):
    """``updates`` optimizer steps, each accumulating ``micro_steps`` calls of ``pm.step`` (all but the
    last under ``no_sync``), against single-device accumulation of the same batches."""
    torch.manual_seed(0)
    model = VARIANTS[name]()
    ref = copy.deepcopy(model)
    xs, ys = batches(micro_steps * updates, batch)
    dp = mesh[2]
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=2,
                               example_input=xs[0, : batch // dp // 2], **kw)
    rows = slice(pm.dp_rank * batch // dp, (pm.dp_rank + 1) * batch // dp)
    train_accumulating(pm, ref, xs, ys, rows, micro_steps, updates, lr)
    return {"param_diff": max_diff(pm.full_state_dict(), ref.state_dict())}


# ---- item 4: fp16 loss scaling -------------------------------------------------------------------
class _SyncCounter:
    """Counts host syncs (``item``, ``bool``, ``float``, ``int`` of a tensor) while active.

    Not counted: the call gate's row exchange (``gather_rows`` in call_gate.py), which runs on the world's
    host-side control group (gloo) even under NCCL, so reading it never waits for the device.  On this
    CPU-only test every tensor is a host tensor, so that one is told apart by where it is read."""

    NAMES = ("item", "__bool__", "__float__", "__int__", "tolist")

    def __enter__(self):
        self.count, self.saved, self.paused = 0, {n: getattr(torch.Tensor, n) for n in self.NAMES}, False
        for name, fn in self.saved.items():
            def counted(t, *a, _fn=fn, **k):
                self.count += not self.paused
                return _fn(t, *a, **k)
            setattr(torch.Tensor, name, counted)
        self.gather_rows = call_gate.gather_rows

        def on_host(*a, **k):
            self.paused = True
            try:
                return self.gather_rows(*a, **k)
            finally:
                self.paused = False
        call_gate.gather_rows = on_host
        return self

    def __exit__(self, *exc):
        for name, fn in self.saved.items():
            setattr(torch.Tensor, name, fn)
        call_gate.gather_rows = self.gather_rows


def fp16_training(mesh=(2, 1, 2), steps: int = 6, poison_step: int = 2, lr: float = 0.1, batch: int = 8):
    """fp16 autocast with the dynamic loss scaler against fp32 single-device SGD on the same data.
    The loss of the last rank is made inf at ``poison_step``: every rank must skip that step (the
    reference skips it too).  growth_interval=2: the scale doubles after 2 clean steps."""
    torch.manual_seed(0)
    model = VARIANTS["timm_cls"]()
    ref = copy.deepcopy(model)
    xs, ys = batches(steps, batch)
    poison = [False]

    def loss_fn(out, y):
        loss = F.cross_entropy(out, y)
        return loss * float("inf") if poison[0] and dist.get_rank() == dist.get_world_size() - 1 else loss

    dp = mesh[2]
    pm = autosplit.parallelize(model, mesh=mesh, loss_fn=loss_fn, num_microbatches=2,
                               example_input=xs[0, : batch // dp // 2], autocast=torch.float16)
    pm.scaler.growth_interval = 2
    pm.scaler.scale = 2.0 ** 10         # 2**16 overflows this model's fp16 gradients at once
    rows = slice(pm.dp_rank * batch // dp, (pm.dp_rank + 1) * batch // dp)
    opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr)
    scales, skipped, syncs, losses, ref_losses = [], [], [], [], []
    n_grads = 0
    for i in range(steps):
        poison[0] = i == poison_step
        scales.append(pm.scaler.scale)
        with _SyncCounter() as c:            # the whole step: the loss and the overflow verdict together
            losses.append(pm.step(xs[i][rows], ys[i][rows]))
        syncs.append(c.count)
        skipped.append(pm.scaler.skipped)
        n_grads = max(n_grads, sum(p.grad is not None for p in pm.parameters()))
        opt.step()
        opt.zero_grad()
        loss = F.cross_entropy(ref(xs[i]), ys[i])
        ref_losses.append(loss.item())
        if not pm.scaler.skipped:      # the reference skips what the scaler skipped
            loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
    state, ref_state = pm.full_state_dict(), ref.state_dict()
    scale_of = max(ref_state[k].abs().max().item() for k in ref_state)
    return {"param_diff": max_diff(state, ref_state), "param_scale": scale_of, "scales": scales,
            "skipped": skipped, "syncs": syncs, "grads": n_grads, "params": len(list(pm.parameters())),
            "loss_diff": max(abs(a - b) for i, (a, b) in enumerate(zip(losses, ref_losses)) if i != poison_step)}


# ---- item 5: buffers under dp --------------------------------------------------------------------
class ConvBN(torch.nn.Module):
    """A small hand-written CNN with BatchNorm: running statistics are buffers updated in forward."""

    def __init__(self, classes: int = 7):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 8, 3, padding=1, stride=2), torch.nn.BatchNorm2d(8)
        self.conv3, self.bn3 = torch.nn.Conv2d(8, 16, 3, padding=1, stride=2), torch.nn.BatchNorm2d(16)
        self.head = torch.nn.Linear(16, classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        x = torch.relu(self.bn3(self.conv3(x)))
        return self.head(x.mean(dim=(2, 3)))


def accumulation_reference(model, xs, ys, dp: int, m: int, lr: float, optimizer=torch.optim.SGD):
    """Single-device reference of per-microbatch, per-replica BatchNorm with DDP-style buffers: each step
    accumulates the gradients of every replica's microbatches (each replica starting from the step's
    buffers, loss / (dp*m)), then the buffers are replica 0's (what dp rank 0 broadcasts), then one
    ``optimizer`` step.  Returns the losses (each global batch's mean microbatch loss) and the state dict."""
    opt = optimizer(model.parameters(), lr=lr)
    losses = []
    for x, y in zip(xs, ys):
        start = {k: v.clone() for k, v in model.named_buffers()}
        replica0, total = None, 0.0
        for k, (xr, yr) in enumerate(zip(x.chunk(dp), y.chunk(dp))):
            with torch.no_grad():                      # every replica starts from the step's buffers
                for name, b in model.named_buffers():
                    b.copy_(start[name])
            for xm, ym in zip(xr.chunk(m), yr.chunk(m)):
                loss = F.cross_entropy(model(xm), ym) / (dp * m)
                loss.backward()
                total += loss.item()
            if k == 0:
                replica0 = {name: b.clone() for name, b in model.named_buffers()}
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(replica0[name])
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, model.state_dict()


def buffers_under_dp(mesh, steps: int = 3, batch: int = 8, m: int = 2, lr: float = 0.1):
    torch.manual_seed(0)
    model = ConvBN()
    ref = copy.deepcopy(model)
    xs, ys = batches(steps, batch)
    dp = mesh[2]
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=m, example_input=xs[0, : batch // dp // m])
    rows = slice(pm.dp_rank * batch // dp, (pm.dp_rank + 1) * batch // dp)
    train_steps(pm, torch.optim.SGD(pm.parameters(), lr=lr), xs, ys, rows)
    pm.train()
    pm.predict(xs[0][rows])          # a training-mode forward updates the statistics too
    state = pm.full_state_dict()
    _, ref_state = accumulation_reference(ref, xs, ys, dp, m, lr)
    with torch.no_grad():            # ... and so does the reference's replica-0 forward
        ref.train()
        for xm in xs[0][: batch // dp].chunk(m):
            ref(xm)
    ref_state = ref.state_dict()
    flat = torch.cat([state[k].double().reshape(-1) for k in sorted(state)])
    return {"state": flat, "buffer_diff": max_diff({k: state[k] for k in state if "running" in k or "batches" in k},
                                                    {k: ref_state[k] for k in state if "running" in k or "batches" in k}),
            "param_diff": max_diff(state, ref_state)}


# ---- item 2: train / eval mode follows pm.train() / pm.eval() --------------------------------------
def dropout_vit(drop_path: float = 0.0, p: float = 0.3):
    """A timm ViT with attention dropout (a constant SDPA argument once traced), projection and MLP
    dropout (nn.Dropout) and optionally DropPath (ops that differ between the modes)."""
    import timm
    return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                         mlp_ratio=2, num_classes=10, attn_drop_rate=p, proj_drop_rate=p,
                                         drop_path_rate=drop_path)


def eval_mode(mesh, drop_path: float = 0.0, batch: int = 4, **kw):
    torch.manual_seed(0)
    model = dropout_vit(drop_path)
    ref = copy.deepcopy(model).eval()
    x = batches(1, batch)[0][0]
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=2, example_input=x[: batch // 2], **kw)
    with torch.no_grad():
        want = ref(x)
    pm.eval()
    a, b = pm.predict(x), pm.predict(x)
    pm.train()
    c, d = pm.predict(x), pm.predict(x)
    return {"eval_repeat": (a - b).abs().max().item(), "eval_vs_ref": (a - want).abs().max().item(),
            "train_repeat": (c - d).abs().max().item(), "train_vs_ref": (c - want).abs().max().item()}


# ---- item 3: dropout masks under tensor parallelism ------------------------------------------------
def tp_dropout_masks(sequence_parallel: bool = False, batch: int = 4, mesh=None):
    """One training step of a dropout ViT on (1, tp, 1) (or ``mesh``); every nn.Dropout call's mask (output zero
    where the input is not) by module path, the default CPU RNG state after the step, and how many
    times the step called torch.manual_seed."""
    import timm
    torch.manual_seed(0)
    model = timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                          mlp_ratio=2, num_classes=10, attn_drop_rate=0.3, proj_drop_rate=0.3,
                                          pos_drop_rate=0.3, drop_rate=0.3)
    masks: dict[str, list] = {}

    def hook(name):
        def fn(module, inputs, output):
            if output.device.type == "meta":       # planning runs the graph on meta tensors
                return
            masks.setdefault(name, []).append(((output == 0) & (inputs[0] != 0)).detach().clone())
        return fn

    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Dropout) and m.p > 0:
            m.register_forward_hook(hook(name))
    xs, ys = batches(1, batch)
    pm = autosplit.parallelize(model, mesh=mesh or (1, dist.get_world_size(), 1), num_microbatches=2,
                               example_input=xs[0, : batch // 2], sequence_parallel=sequence_parallel)
    pm.train()
    seeded, global_seed = [], torch.manual_seed           # counts the step's torch.manual_seed calls

    def counting(seed):
        seeded.append(seed)
        return global_seed(seed)
    torch.manual_seed = counting
    try:
        pm.step(xs[0], ys[0])
    finally:
        torch.manual_seed = global_seed
    return {"masks": {k: torch.stack(v) for k, v in masks.items()}, "rng": torch.get_rng_state(),
            "global_seeds": len(seeded)}


def checkpoint_replays_tp_dropout(checkpoint, sequence_parallel: bool = False, steps: int = 2, batch: int = 4):
    """Parameters after ``steps`` SGD steps of a dropout ViT on (1, tp, 1): with checkpoint="block"
    the recomputed forward must draw the same masks as the first forward, so the result equals
    training without checkpointing (same seeds)."""
    import timm
    torch.manual_seed(0)
    model = timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                                          mlp_ratio=2, num_classes=10, attn_drop_rate=0.3, proj_drop_rate=0.3)
    xs, ys = batches(steps, batch)
    pm = autosplit.parallelize(model, mesh=(1, dist.get_world_size(), 1), num_microbatches=2,
                               example_input=xs[0, : batch // 2], recompute=checkpoint,
                               sequence_parallel=sequence_parallel)
    pm.train()
    opt = torch.optim.SGD(pm.parameters(), lr=0.5)
    torch.manual_seed(7)
    for x, y in zip(xs, ys):
        pm.step(x, y)
        opt.step()
        opt.zero_grad()
    return pm.full_state_dict()
