"""Models built on the meta device (issue 10): ``parallelize(meta_model, seed=, init_fn=)`` gives every
rank the slices that ``autosplit.materialize`` gives one device, allocates nothing outside its shards,
and trains exactly like single-device training of the materialized model (real gloo processes)."""
from __future__ import annotations

import gc
import math

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

import autosplit
from autosplit.errors import AutosplitError
from tests.dist_checks import batches, train_steps
from tests.models import VARIANTS, HandViT

TOL = 1e-5
SEED = 7


def adamw(params, lr: float = 1e-3) -> torch.optim.AdamW:
    """AdamW with eps=1e-6: the attention's key bias has an exactly zero gradient (softmax ignores a
    shift shared by a row's logits), so its gradient is fp32 rounding noise (~1e-10) that depends on the
    summation order; Adam's default eps=1e-8 would turn that noise into steps of ~lr/100, eps=1e-6 into
    steps below 1e-7.  Real gradients (>= 1e-4 here) are unaffected."""
    return torch.optim.AdamW(params, lr=lr, eps=1e-6)


def timm_init(name: str, t: torch.Tensor) -> None:
    """timm's ViT init scheme (init_weights_vit_timm), written as an init_fn (the README's)."""
    from timm.layers import trunc_normal_
    if name in ("cls_token", "reg_token"):
        nn.init.normal_(t, std=1e-6)
    elif t.dim() == 4:                                    # patch embedding: PyTorch's conv default
        nn.init.kaiming_uniform_(t, a=math.sqrt(5))
    elif name == "pos_embed" or t.dim() == 2:             # position embedding and every Linear weight
        trunc_normal_(t, std=.02)
    elif name.endswith("bias"):
        nn.init.zeros_(t)
    else:                                                 # norm weights
        nn.init.ones_(t)


class ResetViT(HandViT):
    """HandViT whose own reset_parameters covers its position embedding: no init_fn needed."""

    def reset_parameters(self):
        nn.init.normal_(self.pos, std=0.02)


MODELS = {"tp_timm": (VARIANTS["tp_timm"], timm_init), "reset_hand": (lambda: ResetViT(depth=2, heads=4), None),
          # wide enough that its parameters (1.6 MB) dwarf the other tensors a rank keeps
          "wide_hand": (lambda: ResetViT(dim=128, depth=2, heads=4), None)}


def _meta(variant: str) -> nn.Module:
    with torch.device("meta"):
        return MODELS[variant][0]()


def _tensors(modules) -> dict[int, torch.Tensor]:
    out = {}
    for m in modules:
        for t in list(m.parameters()) + list(m.buffers()):
            if not t.is_meta:
                out[t.untyped_storage().data_ptr()] = t
    return out


def reference(variant: str, steps: int, batch: int = 8, lr: float = 1e-3, seed: int = 1):
    """Losses and state dict of AdamW training of ``materialize(meta model)`` on one device."""
    model = autosplit.materialize(_meta(variant), seed=SEED, init_fn=MODELS[variant][1])
    opt = adamw(model.parameters(), lr)
    xs, ys = batches(steps, batch, seed)
    losses = []
    for x, y in zip(xs, ys):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()


def meta_train(variant: str, mesh, steps: int = 3, batch: int = 8, microbatches: int = 2, lr: float = 1e-3, **kw):
    """On every rank: parallelize a meta model, count the bytes it allocated, train with AdamW."""
    model = _meta(variant)
    full_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    xs, ys = batches(steps, batch)
    dp = mesh[2]
    # a fixed cost profile: the cut must not depend on how loaded the machine is while measuring
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=microbatches, seed=SEED, device="h100",
                               init_fn=MODELS[variant][1], example_input=xs[0, :batch // dp // microbatches], **kw)
    held = _tensors([model] + pm.raw_modules)            # every real tensor the rank holds
    sharded = pm._sharded()
    local = {n: t for m in pm.raw_modules for n, t in list(m.named_parameters()) + list(m.named_buffers())}
    expected = sum(math.prod(sharded[n].local_shape(pm.tp_rank)) * t.element_size() if n in sharded
                   else t.numel() * t.element_size() for n, t in local.items())
    rows = slice(pm.dp_rank * batch // dp, (pm.dp_rank + 1) * batch // dp)
    losses = train_steps(pm, adamw(pm.parameters(), lr), xs, ys, rows)
    state = pm.full_state_dict()                          # a collective: every rank calls it
    return {"losses": losses, "state": state if torch.distributed.get_rank() == 0 else None,
            "held": sum(t.numel() * t.element_size() for t in held.values()), "expected": expected,
            "full": full_bytes}


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("variant,mesh,kw", [("tp_timm", (2, 2, 1), {}), ("tp_timm", (2, 1, 2), {}),
                                             ("tp_timm", (1, 4, 1), {"tp_mode": "2d"}),
                                             ("reset_hand", (1, 4, 1), {})])
@pytest.mark.default_cases('reset_hand-mesh3-kw3')
def test_meta_model_trains_like_materialized(pool4, variant, mesh, kw):
    """3 AdamW steps: losses and parameters equal materialize(model, seed) trained on one device;
    each rank holds exactly its shards' bytes (and less than the whole model)."""
    results = pool4.run(meta_train, variant, mesh, **kw)
    ref_losses, ref_state = reference(variant, 3)
    assert _max_diff(results[0]["state"], ref_state) <= TOL
    for r in results:
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= TOL, (r["losses"], ref_losses)
        assert r["held"] == r["expected"], r
        assert r["held"] < r["full"], r


def live_tensor_bytes(exclude: set[int] = frozenset()) -> int:
    """Bytes of the distinct storages of every live, non-meta plain tensor in the process (but those
    whose storage's ``data_ptr`` is in ``exclude``).

    Every tensor Python code can reach is an object the garbage collector tracks (parameters and
    their shards, buffers, gradients, optimizer state, and whatever a plan, a closure or a list keeps),
    so this counts them all, wherever they are held, each storage once (views share it).  A DTensor is a
    wrapper without storage of its own: its local shard is a plain tensor, counted as such.  Tensors
    only C++ holds (autograd's saved tensors) are not seen; after a step none are left."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        # fake tensors (a compiled graph's shapes, held by dynamo's caches in a pool process that
        # compiled before) have no storage
        if isinstance(obj, torch.Tensor) and not isinstance(obj, DTensor) and not obj.is_meta and not is_fake(obj):
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(n for ptr, n in storages.items() if ptr not in exclude)


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def meta_sharded(variant: str, mesh, dp_shard: str, steps: int = 2, batch: int = 8, microbatches: int = 2):
    """On every rank: a meta model under ``dp_shard``: the live tensor bytes right after parallelize
    and after AdamW steps (``live_tensor_bytes``, less what was live before and the optimizer's
    moments), against this rank's shard bytes (the local parts of its parameters and buffers) and its
    stages' full bytes; how far the full state dict before any step is from ``materialize``'s; the losses."""
    xs, ys = batches(steps, batch)
    example = xs[0, :batch // mesh[2] // microbatches].clone()
    before = live_tensor_bytes()
    model = _meta(variant)
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=microbatches, seed=SEED, device="h100",
                               init_fn=MODELS[variant][1], example_input=example, dp_shard=dp_shard)
    held = live_tensor_bytes() - before
    local = [t for m in pm.raw_modules for t in list(m.parameters()) + list(m.buffers())]
    shards = sum(_local_bytes(t) for t in local)
    stage = sum(math.prod(t.shape) * t.element_size() for t in local)     # full (tp-local) shapes
    state = pm.full_state_dict()                          # a collective: every rank calls it
    init_diff = _max_diff(state, autosplit.materialize(_meta(variant), seed=SEED, init_fn=MODELS[variant][1])
                          .state_dict())
    del state                                             # whole tensors: not to be counted below
    opt = adamw(pm.parameters())
    rows = slice(pm.dp_rank * batch // mesh[2], (pm.dp_rank + 1) * batch // mesh[2])
    losses = []
    for x, y in zip(xs, ys):
        losses.append(pm.step(x[rows], y[rows]))
        opt.step()
        opt.zero_grad()
    moments = sum(_local_bytes(v) for st in opt.state.values() for v in st.values() if v.dim() > 0)
    trained = live_tensor_bytes() - before - moments
    return {"held": held, "trained": trained, "shards": shards, "stage": stage, "losses": losses,
            "init_diff": init_diff, "sharded": sum(isinstance(p, DTensor) for p in pm.parameters())}


@pytest.mark.parametrize("mesh,dp_shard", [((1, 1, 4), "stage"), ((1, 2, 2), "layer")])
@pytest.mark.default_cases('mesh0-stage')
def test_meta_model_sharded_over_dp_holds_only_its_shards(pool4, mesh, dp_shard):
    """A meta model under ``dp_shard`` is materialized into the FSDP shards: each rank holds its
    shards' bytes (not its whole stage, which the user's model, the plan's modules or a copy kept
    alive before: 4x the shards at dp=4), right after parallelize and after AdamW steps (less the
    optimizer's moments), with the values ``materialize`` gives on one device, and trains like it."""
    results = pool4.run(meta_sharded, "wide_hand", mesh, dp_shard)
    ref_losses, _ = reference("wide_hand", 2)
    slack = 64 * 2**10        # the executor's and collectives' small tensors
    for r in results:
        assert r["sharded"] > 0 and r["init_diff"] == 0, r
        assert max(abs(a - b) for a, b in zip(r["losses"], ref_losses)) <= TOL, (r["losses"], ref_losses)
        assert r["stage"] >= 1.9 * r["shards"], r       # dp=2 or 4: the whole stage is 2-4x the shards
        assert r["held"] <= 1.02 * r["shards"] + slack, r
        assert r["trained"] <= 1.02 * r["shards"] + slack, r


def test_materialize_is_deterministic_and_leaves_rng_alone():
    torch.manual_seed(3)
    before = torch.get_rng_state()
    a = autosplit.materialize(_meta("tp_timm"), seed=SEED, init_fn=timm_init).state_dict()
    assert torch.equal(torch.get_rng_state(), before)
    b = autosplit.materialize(_meta("tp_timm"), seed=SEED, init_fn=timm_init).state_dict()
    c = autosplit.materialize(_meta("tp_timm"), seed=SEED + 1, init_fn=timm_init).state_dict()
    assert _max_diff(a, b) == 0 and _max_diff(a, c) > 0
    assert a["blocks.0.attn.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.2)   # timm's trunc_normal


def test_reset_parameters_seeded_per_module():
    """Without init_fn each module's own reset_parameters runs, seeded from (seed, module name):
    two Linear layers of equal shape get different values; buffers (BatchNorm) are reset too."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.BatchNorm1d(4))
    autosplit.materialize(model, seed=1)
    assert not torch.equal(model[0].weight, model[1].weight)
    assert torch.equal(model[2].running_var, torch.ones(4)) and model[2].num_batches_tracked.item() == 0
    assert not any(t.is_meta for t in model.state_dict().values())


def test_uncovered_tensors_are_listed():
    with pytest.raises(AutosplitError) as err:
        autosplit.materialize(_meta("tp_timm"))
    msg = str(err.value)
    assert "'cls_token' (VisionTransformer)" in msg and "'pos_embed'" in msg and "init_fn" in msg, msg


def test_reset_that_leaves_a_tensor_is_refused():
    class Half(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Parameter(torch.empty(3)), nn.Parameter(torch.empty(3))

        def reset_parameters(self):
            nn.init.zeros_(self.a)

    with torch.device("meta"):
        model = Half()
    with pytest.raises(AutosplitError, match="left 'b' uninitialized"):
        autosplit.materialize(model)


@pytest.mark.slow
def test_materialize_stays_the_function_after_the_runtime_loads():
    """The runtime imports the module that defines ``materialize``; ``autosplit.materialize`` must still be
    the function (it was shadowed by a submodule of the same name before)."""
    import subprocess
    import sys
    code = ("import autosplit.runtime.parallel_module, autosplit, inspect; "
            "assert inspect.isfunction(autosplit.materialize), autosplit.materialize")
    subprocess.run([sys.executable, "-c", code], check=True)
