"""Initial values for a model built on the meta device, the same whatever the mesh.

Terms:
  meta tensor  -- a parameter or buffer on ``torch.device("meta")``: a shape and a dtype, no storage.
  full value   -- a meta tensor's initial value at its full shape, on the CPU.  Every rank computes
                  the full value of each tensor it holds a part of (one owner module's tensors at a
                  time) and keeps only its slice, so the values never depend on the mesh, and
                  ``materialize`` (one device) gives the same numbers as ``parallelize`` on any mesh.
  seed of a name -- ``seed_of(seed, name)``: a 63-bit hash of (seed, name).  Torch's default CPU
                  generator is seeded with it before a tensor (``init_fn``) or a module
                  (``reset_parameters``) is initialized, inside ``torch.random.fork_rng``, so the
                  caller's random state is left as it was.
  init_fn      -- ``init_fn(name, tensor)``: initializes one full-shape CPU tensor in place; it owns
                  every meta tensor (parameters and buffers) of the model.
  reset        -- without ``init_fn``: each module's own ``reset_parameters()`` initializes the
                  parameters and buffers the module holds directly (seeded from the module's name).  It
                  runs on a *twin*: a shallow copy of the module holding full-shape CPU tensors and no
                  submodules.  A meta tensor whose module has no ``reset_parameters`` is *uncovered*.

Values are computed on the CPU so that they do not depend on the device either (a CUDA generator
draws other numbers than the CPU one for the same seed).  Pure: no process group.
"""
from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from autosplit.errors import AutosplitError

_LISTED = 8          # uncovered tensors named in the error


def seed_of(seed: int, name: str) -> int:
    """The generator seed of one tensor or module: a stable hash of (seed, name)."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def meta_names(model: nn.Module) -> list[str]:
    """Names of the model's parameters and buffers that live on the meta device."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    return [name for name, t in tensors if t.is_meta]


def assign(module: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace the parameter or buffer ``name`` of ``module`` by ``value`` (a Parameter keeps its
    ``requires_grad``).  Meta tensors cannot be filled in place, so the object is replaced."""
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if leaf in owner._parameters:
        old = owner._parameters[leaf]
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        owner._buffers[leaf] = value


class Initializer:
    """Full values of a meta model's tensors; every rank of a job builds the same one.

    Args:
        model: the user's model; only its meta tensors are initialized.
        seed: an int; each tensor's (or module's) generator seed is ``seed_of(seed, name)``.
        init_fn: ``init_fn(name, tensor)`` or None (each module's ``reset_parameters``).

    Raises AutosplitError naming the meta tensors no ``reset_parameters`` covers (without init_fn).
    """

    def __init__(self, model: nn.Module, seed: int = 0, init_fn: Callable | None = None):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise AutosplitError(f"seed={seed!r} must be an int")
        if init_fn is not None and not callable(init_fn):
            raise AutosplitError(f"init_fn={init_fn!r} must be a function init_fn(name, tensor) that "
                                 f"initializes a full-shape tensor in place")
        self.model, self.seed, self.init_fn = model, seed, init_fn
        tensors = list(model.named_parameters()) + list(model.named_buffers())
        self.shapes = {n: (t.shape, t.dtype) for n, t in tensors if t.is_meta}
        self.names = list(self.shapes)
        self.owner = {n: n.rpartition(".")[0] for n in self.names}    # tensor name -> its module's path
        if init_fn is None:
            self._check_covered()

    def _check_covered(self) -> None:
        uncovered = [n for n in self.names
                     if not callable(getattr(self.model.get_submodule(self.owner[n]), "reset_parameters", None))]
        if not uncovered:
            return
        shown = ", ".join(f"'{n}' ({type(self.model.get_submodule(self.owner[n])).__name__})"
                          for n in uncovered[:_LISTED])
        more = f" and {len(uncovered) - _LISTED} more" if len(uncovered) > _LISTED else ""
        raise AutosplitError(
            f"the model is on the meta device and {len(uncovered)} of its tensors belong to modules without "
            f"reset_parameters(), so nothing says how to initialize them: {shown}{more}. Pass "
            f"init_fn(name, tensor) (it initializes every parameter and buffer at full shape, in place; see "
            f"'Bigger than one device' in the README for timm's scheme) or load a checkpoint after "
            f"parallelize (pm.load_checkpoint)")

    def values(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full value on the CPU) for each of ``names`` (meta tensors of the model), one owner
        module at a time, so at most one module's tensors are alive at full shape."""
        wanted = set(names)
        unknown = wanted - set(self.names)
        if unknown:
            raise AutosplitError(f"not meta tensors of the model: {sorted(unknown)[:_LISTED]}")
        by_owner: dict[str, list[str]] = {}
        for n in self.names:                      # the model's order: the same on every rank
            if n in wanted:
                by_owner.setdefault(self.owner[n], []).append(n)
        for owner, group in by_owner.items():
            if self.init_fn is not None:
                for n in group:
                    yield n, self._by_init_fn(n)
            else:
                yield from self._by_reset(owner, group)

    def _empty(self, name: str) -> torch.Tensor:
        shape, dtype = self.shapes[name]
        return torch.empty(shape, dtype=dtype, device="cpu")

    def _by_init_fn(self, name: str) -> torch.Tensor:
        full = self._empty(name)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.default_generator.manual_seed(seed_of(self.seed, name))
            self.init_fn(name, full)
        return full

    def _by_reset(self, owner: str, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        module = self.model.get_submodule(owner)
        twin = copy.copy(module)                  # own tensor dicts below; the module is not touched
        params, buffers = {}, {}
        for k, p in module._parameters.items():
            params[k] = None if p is None else nn.Parameter(_filled(p), requires_grad=p.requires_grad)
        for k, b in module._buffers.items():
            buffers[k] = None if b is None else _filled(b)
        twin.__dict__.update(_parameters=params, _buffers=buffers, _modules={})
        label = owner or type(self.model).__name__
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.default_generator.manual_seed(seed_of(self.seed, owner))
            try:
                twin.reset_parameters()
            except AttributeError as exc:
                raise AutosplitError(f"'{label}'.reset_parameters() reads something the module does not hold "
                                     f"itself ({exc}); pass init_fn(name, tensor) to initialize the meta model"
                                     ) from exc
        tensors = {**{k: v for k, v in params.items() if v is not None},
                   **{k: v for k, v in buffers.items() if v is not None}}
        for n in names:
            value = tensors[n.rpartition(".")[2]].detach()
            if value.is_floating_point() and bool(value.isnan().any()):
                raise AutosplitError(f"'{label}'.reset_parameters() left '{n}' uninitialized; pass "
                                     f"init_fn(name, tensor) to initialize the meta model")
            yield n, value


def _filled(t: torch.Tensor) -> torch.Tensor:
    """A full-shape CPU tensor a reset must overwrite: NaN (floating point) or zeros."""
    full = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return full.fill_(float("nan")) if full.is_floating_point() else full.zero_()


def materialize(model: nn.Module, seed: int = 0, init_fn: Callable | None = None,
                device: torch.device | str = "cpu") -> nn.Module:
    """Give a meta-device model real, initialized tensors on one device; returns ``model`` (in place).

    The values are exactly those ``autosplit.parallelize(model, ..., seed=seed, init_fn=init_fn)`` gives
    each rank's shards, on any mesh.  Tensors already off the meta device are left as they are.

    Args:
        model: a model built under ``with torch.device("meta"):`` (or partly on it).
        seed: an int; a tensor's generator is seeded from (seed, its name) (see ``seed_of``).
        init_fn: ``init_fn(name, tensor)`` initializes one full-shape tensor in place, with torch's
            default generator seeded from (seed, name); it owns every meta parameter and buffer.
            None: each module's own ``reset_parameters()``, seeded from (seed, module name); a meta
            tensor no such method covers (a class token, a position embedding) raises an error
            listing them.
        device: where the tensors go (they are computed on the CPU, then moved).
    """
    init = Initializer(model, seed, init_fn)
    for name, full in init.values(init.names):
        assign(model, name, full.to(device))
    return model
