import copy, torch, autosplit
from tests.models import VARIANTS
from tests.dist_checks import batches

def grads(name, mesh, microbatches=2, **kw):
    torch.manual_seed(0)
    model = VARIANTS[name]()
    ref = copy.deepcopy(model)
    xs, ys = batches(1, 8)
    loss = torch.nn.functional.cross_entropy(ref(xs[0]), ys[0]); loss.backward()
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=microbatches, example_input=xs[0][:8 // microbatches], **kw)
    l = pm.step(xs[0], ys[0])
    full = {}
    # gradient as full tensors: use optimizer trick: set params = grads
    with torch.no_grad():
        for p in pm.parameters():
            p.copy_(p.grad)
    st = pm.full_state_dict()
    out = {k: (st[k] - p.grad).abs().max().item() for k, p in ref.named_parameters()}
    return {"loss": abs(l - loss.item()), "bad": {k: v for k, v in out.items() if v > 1e-5}}

def local_grads(name, mesh, microbatches=2, **kw):
    torch.manual_seed(0)
    model = VARIANTS[name]()
    ref = copy.deepcopy(model)
    xs, ys = batches(1, 8)
    loss = torch.nn.functional.cross_entropy(ref(xs[0]), ys[0]); loss.backward()
    pm = autosplit.parallelize(model, mesh=mesh, num_microbatches=microbatches, example_input=xs[0][:8 // microbatches], **kw)
    pm.step(xs[0], ys[0])
    out = {}
    for n, p in pm.named_parameters():
        if "cls_token" in n or "pos_embed" in n:
            out[n] = p.grad.flatten()[:4].tolist()
    out["ref_cls"] = ref.cls_token.grad.flatten()[:16].tolist()
    out["ref_pos0"] = ref.pos_embed.grad[0, 0].flatten()[:16].tolist()
    out["tp_rank"] = pm.tp_rank
    return out
