"""Give every node the dtype ``torch.autocast`` really produces, by running the graph under autocast.

Terms:
  autocast dtype -- torch.bfloat16 or torch.float16: the "lower precision" dtype of ``torch.autocast``.
  device type    -- "cuda" or "cpu": autocast's op lists differ per device (CUDA runs layer_norm and
                    softmax in float32, CPU in the input's dtype), so we use the lists of the device the
                    plan is for (``DeviceProfile.device_type``).
  fake tensor    -- a ``torch._subclasses.FakeTensor``: like a meta tensor (shape, dtype, no storage),
                    but it reports a real device, so the Autocast dispatch key of that device runs.
                    Autocast does not act on meta tensors; this is why the pass exists.

Why run autocast instead of copying its op lists: the dtypes then come from the same dispatcher code
that runs at training time (type promotion of ``fp32 + bf16`` included), for every op in the graph and
inside leaf modules.  Fake CUDA tensors need no GPU; ``torch.autocast("cuda")`` refuses to turn on
without one, so the autocast state is set with the low-level setters and restored afterwards.

Requires ``meta['val']`` (MetaShapeProp); replaces each tensor in it by a meta tensor of the same shape
and strides with the autocast dtype.  Collective ops (``target.comm_kind``) keep their input's dtype.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.fx.passes.infra.pass_base import PassResult
from torch.utils._pytree import tree_leaves, tree_map

from autosplit.errors import AutosplitError
from autosplit.passes.infra import MetaPass
from autosplit.passes.op_registry import cost_entry
from autosplit.passes.shape_prop import run_on_zeros

HALF_DTYPES = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def autocast_state(device_type: str, dtype: torch.dtype):
    """Autocast on for ``device_type`` even where that device is absent (fake tensors only)."""
    before = torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)
    torch.set_autocast_enabled(device_type, True)
    torch.set_autocast_dtype(device_type, dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled(device_type, before[0])
        torch.set_autocast_dtype(device_type, before[1])
        torch.clear_autocast_cache()


def _to_meta(value):
    """Plain meta tensors (made outside the fake mode, or they would be fake tensors on "meta")."""
    with unset_fake_temporarily():
        return tree_map(lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
                        if isinstance(x, torch.Tensor) else x, value)


class _FakeInterpreter(fx.Interpreter):
    """Runs the graph on fake tensors of ``device``; parameters become fake tensors as they are read."""

    def __init__(self, gm: fx.GraphModule, device: torch.device, device_type: str, dtype: torch.dtype):
        super().__init__(gm)
        self.device, self.device_type, self.dtype = device, device_type, dtype

    def fake(self, value):
        return tree_map(lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=self.device)
                        .requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x, value)

    def get_attr(self, target, args, kwargs):
        return self.fake(super().get_attr(target, args, kwargs))

    def call_function(self, target, args, kwargs):
        if getattr(target, "comm_kind", None) and not cost_entry(self.current).cost:
            # a collective moves data, never changes its dtype (ops that also compute, linear_2d and
            # layer_norm_2d, run their planning path below, which follows autocast)
            node = self.current
            first = next(x for x in tree_leaves(args) if isinstance(x, torch.Tensor))
            return tree_map(lambda v: v.to(first.dtype) if isinstance(v, torch.Tensor) else v,
                            self.fake(node.meta["val"]))
        return super().call_function(target, args, kwargs)

    def call_module(self, target, args, kwargs):
        module = self.fetch_attr(target)
        state = {name: self.fake(t) for name, t in module.state_dict(keep_vars=True).items()}
        try:
            return torch.func.functional_call(module, state, tuple(args), dict(kwargs))
        except Exception:
            # A leaf that branches on tensor values cannot run on fake tensors: run it once on zeros on
            # the CPU under CPU autocast (its op lists can differ from CUDA's for this one module).
            with unset_fake_temporarily(), autocast_state("cpu", self.dtype):
                out = _to_meta(run_on_zeros(module, args, kwargs))
            return self.fake(out)

    def run_node(self, n: fx.Node):
        self.current = n
        try:
            result = super().run_node(n)
        except Exception as exc:
            raise AutosplitError(
                f"autocast={self.dtype}: dtype propagation failed at node '{n.name}' ({n.op} {n.target}) in "
                f"module '{n.meta.get('module_path', '')}': {type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
        n.meta["val"] = _to_meta(result)
        return result


class AutocastDtypeProp(MetaPass):
    """Requires meta['val'].  Ensures meta['val'] carries the dtypes autocast produces on the device."""

    requires_meta = ("val",)
    ensures_meta = ("val",)

    def __init__(self, example_inputs: tuple, dtype: torch.dtype, device_type: str = "cuda"):
        if dtype not in HALF_DTYPES:
            raise AutosplitError(f"autocast={dtype!r}: expected None, torch.bfloat16 or torch.float16")
        self.example_inputs, self.dtype, self.device_type = tuple(example_inputs), dtype, device_type

    def call(self, graph_module: fx.GraphModule) -> PassResult:
        device = torch.device(self.device_type)
        interp = _FakeInterpreter(graph_module, device, self.device_type, self.dtype)
        with FakeTensorMode(), autocast_state(self.device_type, self.dtype), torch.no_grad():
            interp.run(*interp.fake(self.example_inputs))
        return PassResult(graph_module, False)
