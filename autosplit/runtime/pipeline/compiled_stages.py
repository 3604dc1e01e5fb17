"""``compile_stages``: run this rank's stage modules through ``torch.compile``.

Terms:
  settings  -- the keyword arguments handed to ``torch.compile`` (``backend``, default inductor;
               ``mode``; ``dynamic``; ``fullgraph``; ``options``): ``compile_stages=True`` is ``{}``, a
               dict gives them.
  unit      -- what one ``torch.compile`` call covers: a stage GraphModule's ``forward``; under
               activation checkpointing the module inside each ``Checkpointed`` (the recomputation
               re-runs the compiled forward, as torchtitan orders compile inside checkpointing); for a
               stage split into layer runs (``recompute="block"``, FSDP2 layer units) each run.  Why the
               ``forward`` and not the module's ``__call__``: the hooks around a call (FSDP2's
               all-gather and reshard, torch's checkpoint) stay outside the graph, eager, where they are
               built to run; the graph holds only the stage's own ops, and so has no break.
  signature -- the (shape, dtype) of a unit's tensor inputs and the grad mode: dynamo compiles once per
               signature (a guard failure recompiles), so a new signature is logged where it happens;
               a fixed microbatch compiles each unit once for training and once for ``predict``.
  compile time -- torch's own timers (``torch._dynamo.utils.compilation_time_metrics``: dynamo's trace
               and the backend's forward compile, and the backward compiled at its first run), read
               after each step: ``compile_seconds`` and one log line per rank when it grew.
Collectives inside a unit are traceable custom ops (runtime/parallel/traceable_collectives.py), and so are the
weight gradients a zero-bubble W computes (autosplit/weight_grad_ops.py); both are loaded here.
"""
from __future__ import annotations

import logging

import torch
import torch.fx as fx

from autosplit.errors import AutosplitError
from autosplit.runtime.parallel import traceable_collectives  # noqa: F401  (binds the ops dynamo traces)
from autosplit.runtime.parallel.fsdp import unsharded_params
from autosplit.runtime.stage.checkpointing import Checkpointed
from autosplit.weight_grad_ops import register_weights

log = logging.getLogger("autosplit")

SETTINGS = ("backend", "mode", "dynamic", "fullgraph", "options")
# the timers that, summed, are one compile: a frame's (trace + forward compile) and a lazy backward's
_TIMERS = ("_compile.compile_inner", "backward._backward_impl")


def compile_settings(value) -> dict | None:
    """``compile_stages``' value as ``torch.compile`` keyword arguments, or None (off); a bad value is
    refused naming what is accepted."""
    if value is None or value is False:
        return None
    if value is True:
        _refuse_cuda_graphs({})         # inductor's global config may turn them on
        return {}
    if isinstance(value, dict):
        unknown = sorted(set(value) - set(SETTINGS))
        if unknown:
            raise AutosplitError(f"compile_stages={value!r}: unknown key{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(map(repr, unknown))}; a dict takes torch.compile's "
                                 f"{', '.join(SETTINGS)}")
        _check_with_torch(value)
        _refuse_cuda_graphs(value)
        return dict(value)
    raise AutosplitError(f"compile_stages={value!r}: expected True, False, or a dict of torch.compile "
                         f"arguments ({', '.join(SETTINGS)})")


def _check_with_torch(settings: dict) -> None:
    """Let ``torch.compile`` judge the values (a backend's name, a mode, ``dynamic``, inductor's options):
    wrapping a function checks them and compiles nothing (that waits for the first call).  Here, before any
    rendezvous, a bad value is one AutosplitError on every rank, not torch's own error type at the first
    stage built."""
    try:
        torch.compile(lambda x: x, **settings)
    except Exception as exc:    # torch raises InvalidBackend, RuntimeError or AssertionError, by value
        raise AutosplitError(f"compile_stages={settings!r}: torch.compile refuses it: {type(exc).__name__}: "
                             f"{str(exc)[:300]}") from exc


# the modes and backend that record CUDA graphs, and the inductor option that turns them on
_GRAPH_MODES_HINT = ('use mode="max-autotune-no-cudagraphs" (max-autotune\'s kernels without CUDA graphs) or '
                     'mode="default"')


def _cuda_graph_source(settings: dict) -> str | None:
    """What in ``settings`` turns on CUDA graphs (a phrase naming it), or None.  Read from torch's own
    table of modes (``torch._inductor.list_mode_options``: "reduce-overhead" and "max-autotune" set
    ``triton.cudagraphs``), the ``options`` dict, the "cudagraphs" backend, and inductor's global config
    (``torch._inductor.config.triton.cudagraphs = True`` set by the caller)."""
    backend = settings.get("backend", "inductor")
    if backend == "cudagraphs":
        return 'backend="cudagraphs"'
    if backend != "inductor":
        return None
    mode = settings.get("mode")
    if mode is not None:
        from torch._inductor import list_mode_options
        if list_mode_options(mode, settings.get("dynamic")).get("triton.cudagraphs"):
            return f"mode={mode!r} (it sets triton.cudagraphs)"
    options = settings.get("options") or {}
    if options.get("triton.cudagraphs"):
        return "options={'triton.cudagraphs': True}"
    if "triton.cudagraphs" not in options:      # no mode sets it False: the global config then decides
        from torch._inductor import config
        if config.triton.cudagraphs:
            return "torch._inductor.config.triton.cudagraphs = True"
    return None


def _refuse_cuda_graphs(settings: dict) -> None:
    """Refuse settings that record CUDA graphs (issue 50 item 6).  On a graph's replay only the recorded
    kernels run, not Python: the zero-bubble weight-gradient op (autosplit/weight_grad_ops.py) queues its
    GEMMs for W from its Python body, so replayed W gradients would stay zero (silently wrong), and the
    tensor-parallel collectives (runtime/parallel/traceable_collectives.py) would be replayed as
    recorded NCCL kernels outside the watchdog's guarded, deadline-checked calls."""
    source = _cuda_graph_source(settings)
    if source is not None:
        raise AutosplitError(
            f"compile_stages={settings!r}: {source} records CUDA graphs, which autosplit refuses: a graph's "
            f"replay runs none of the custom ops' Python (zero-bubble's deferred weight gradients would stay "
            f"zero) and replays the collectives outside the watchdog; {_GRAPH_MODES_HINT}")


class _CompiledForward:
    """A unit's compiled ``forward``, logging each new input signature (a compile) once."""

    def __init__(self, forward, settings: dict, label: str):
        self.compiled = torch.compile(forward, **settings)
        self.label = label
        self.signatures: set = set()

    def __call__(self, *args, **kwargs):
        signature = (tuple((tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)),
                     torch.is_grad_enabled())
        if signature not in self.signatures:
            again = " (recompiles)" if self.signatures else ""
            log.info("%s: compiling for inputs %s, grad %s%s", self.label,
                     [s for s, _ in signature[0]], "on" if signature[1] else "off", again)
            self.signatures.add(signature)
        return self.compiled(*args, **kwargs)


def _is_split(module: torch.nn.Module) -> bool:
    """A stage split into runs by runtime/stage/checkpointing.py ``split_layers``."""
    return isinstance(module, fx.GraphModule) and getattr(module, "layer_runs", False)


def compile_units(module: torch.nn.Module, settings: dict, label: str) -> int:
    """Compile every unit of the executor's ``module`` in place (see the module docstring); returns
    how many units were compiled."""
    register_weights(module)            # the split GEMMs' Parameters, by storage (weight_grad_ops.py)
    if isinstance(module, Checkpointed):
        return compile_units(module.module, settings, label)
    if _is_split(module):
        return sum(compile_units(child, settings, f"{label} {name}") for name, child in module.named_children()
                   if name.startswith("submod_"))
    # a re-plan may hand back a module compiled before (FSDP2 keeps its units and takes the new graph):
    # drop the old compiled forward, which runs the old graph, and compile the class's current one
    module.__dict__.pop("forward", None)
    module.forward = _CompiledForward(module.forward, settings, label)
    return 1


def unalias_grads(module: torch.nn.Module) -> None:
    """Give every parameter of ``module`` a ``.grad`` that overlaps no other's (call after each backward).

    Why: a compiled backward may return one parameter's gradient as a view into another's (torch 2.14:
    with a one-row microbatch, the class token's gradient is the first row of the position embedding's,
    the sum over the broadcast batch being a no-op), and autograd then keeps both as ``.grad``.  The
    next microbatch's in-place accumulation into one would add into the other too: wrong gradients
    (tests/test_compile_stages.py shows it).  Overlap, not a shared storage, is the fault: the dp
    buckets' ``.grad`` views share one flat buffer on purpose, side by side.  A sweep over the
    gradients' byte spans, sorted by (storage, start), copies each one that overlaps an earlier one.
    Under dp_shard the gradients accumulate on FSDP2's unsharded parameters, which are checked too.
    """
    spans = []
    for p in [*module.parameters(), *unsharded_params(module)]:
        g = p.grad
        if g is None or type(g) is not torch.Tensor or g.numel() == 0:
            continue
        size = g.element_size()            # spans in bytes: one storage may hold tensors of two dtypes
        start = g.storage_offset() * size
        end = start + (sum((n - 1) * st for n, st in zip(g.shape, g.stride())) + 1) * size
        spans.append((g.untyped_storage().data_ptr(), start, end, p))
    spans.sort(key=lambda t: t[:3])
    reach = (None, 0)                   # (storage, furthest end so far in it)
    for address, start, end, p in spans:
        if address == reach[0] and start < reach[1]:
            p.grad = p.grad.clone()
            continue
        reach = (address, max(end, reach[1]) if address == reach[0] else end)


def compile_seconds() -> float:
    """Seconds this process has spent compiling (torch's timers; 0 where this torch keeps none)."""
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    return sum(sum(metrics.get(name, ())) for name in _TIMERS)


def graph_breaks() -> int:
    """Graph breaks dynamo has counted in this process."""
    return sum(torch._dynamo.utils.counters["graph_break"].values())
