"""Every call form of every op the registry names, generated, and a small ViT-like block around each one
(tests/test_op_forms.py plans them; the ranks of a test pool train them here).

How the forms are generated (no form is listed by hand):
  ops        -- every name the registry declares (passes/op_registry.py ``OPS``) that torch spells as a
                callable: ``torch.<name>``, ``torch.nn.functional.<name>``, ``operator.<name>`` (the
                operator module's spelling of ``a + b``, ``a[i]``), the Tensor method ``x.<name>(...)``,
                and the module class ``torch.nn.<Name>``.  A name torch spells in none of these (our own
                ``linear_2d``, timm's ``DropPath``, torch's abstract ``_BatchNorm``) is listed as skipped.
  overloads  -- each of torch's signatures for the callable: the TorchScript schemas
                ``torch.fx.operator_schemas.get_signature_for_torch_op`` gives (a method without a
                ``torch.<name>`` function: the schemas of ``torch.ops.aten.<name>``), else the Python
                signature (``inspect.signature``: ``F.softmax``, operator functions, module
                constructors and forwards).  ``out=`` overloads and ones not taking a tensor first
                (``aten::add.int``; einsum's leading equation aside) are not tensor ops of a model and
                are left out.
  values     -- each parameter takes the first candidate (by its name, else by its type: ``VALUES``)
                for which the whole call runs eagerly on the block's tensors and gives finite values;
                tensors are the block's activations and parameters (``TENSORS``).  A parameter named in
                ``VARIED`` gives one form per candidate that runs (``dim`` 1, the tokens, and -1, the
                features the linears split).
  forms      -- per overload: its required arguments only; every argument we have a value for,
                positionally (keyword-only ones by keyword); the same by keyword after the first; each
                as a function and as a method (``self`` first); and the in-place spellings of the
                required form (``x.add_(y)``, ``F.relu(x, inplace=True)``, ``operator.iadd``).  Forms
                that print alike are one form.

Terms:
  block      -- x (B, N, C) -> LayerNorm -> h = fc1(.), g = fc2(.), both (B, N, H) -> the form -> its
                result fitted to (B, N, H) and added to g -> fc3 -> + x -> mean over tokens -> head.
                Under tp = 2 the linears split H, so the form sees split operands.
  fit        -- how a result becomes (B, N, H): each tensor of it (a tuple's or list's elements, a
                tensor of another dtype cast to the block's float32 (``h.double()``, ``h > 0``), a number
                multiplied in) has its dims matched to B, N, H
                by size (the sizes differ), the rest summed away, the missing ones unsqueezed.
"""
from __future__ import annotations

import copy
import inspect
import itertools
import operator
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.fx.operator_schemas import get_signature_for_torch_op

import autosplit
from autosplit.passes.op_registry import OPS

B, N, C, H, CLASSES = 3, 5, 6, 8, 4
ROLES = (B, N, H)
DTYPE = torch.float32            # the block's (its parameters' and input's)


# -- the block's tensors, by recipe ----------------------------------------------------------------
def _tensors(h, g, m) -> dict:
    """Recipe -> how to make it from h, g (B, N, H) and the block ``m``'s own tensors (lazily)."""
    return {"h": lambda: h, "g": lambda: g, "gT": lambda: g.transpose(-2, -1),     # (B, H, N)
            "hp": lambda: h.sigmoid() + 0.5,                                        # positive
            "hs": lambda: h.sigmoid(),                                              # in (0, 1)
            "w": lambda: m.w, "b": lambda: m.b,                                     # (H, H), (H,)
            "hb": lambda: h > 0, "idx": lambda: m.idx, "gidx": lambda: m.gidx}


TENSORS = ("h", "g", "gT", "hp", "hs", "w", "b", "hb", "idx", "gidx")
_SHAPES = [[-1, N, 2, H // 2], [2, -1, N, H], [-1, N, H], [-1, N * H]]    # -1: the batch
VALUES = {       # by parameter name first, then by type
    "dim": [1, -1, 0], "dim0": [1], "dim1": [-1], "axis0": [1], "axis1": [-1], "start_dim": [1],
    "end_dim": [-1], "source": [1], "destination": [-1], "dims": [[0, 2, 1], [1], 1], "shifts": [1],
    "keepdim": [True], "p": [2, 0.0], "training": [True], "normalized_shape": [[H]], "eps": [1e-5],
    "split_size": [4, [4, 4]], "split_size_or_sections": [4], "split_sizes": [[4, 4]], "chunks": [2],
    "sections": [2], "indices_or_sections": [2], "indices": [[3]], "size": _SHAPES + [2], "shape": _SHAPES, "dimension": [1],
    "sizes": [[2, H // 2]], "repeats": [[1, 1, 2]], "equation": ["bnh,bmh->bnm"], "exponent": [2.0],
    "alpha": [0.5], "value": [0.5], "other": [2.0], "dtype": [torch.float32], "approximate": ["tanh"],
    "negative_slope": [0.1], "start": [0], "length": [2], "index": [1], "pad": [[1, 1]],
    "output_size": [1, [1]], "kernel_size": [1, [1]], "step": [1], "beta": [0.5], "lambd": [0.5],
    "getitem.b": [(slice(None), slice(1, 3)), (Ellipsis, slice(0, 4)), (slice(None), 0), (slice(None), None),
          (Ellipsis, 1)],                        # operator.getitem(a, b): the index
    "in_features": [H], "out_features": [H], "embed_dim": [H], "num_heads": [2], "batch_first": [True],
    "in_channels": [N], "out_channels": [N], "num_groups": [1], "num_channels": [N],
    "unflattened_size": [[2, H // 2]], "num_features": [N], "stride": [1], "dropout_p": [0.0],
}
BY_TYPE = {"int": [1, -1], "SymInt": [2], "float": [0.5], "bool": [True, False], "Scalar": [2.0, 0.5],
           "int[]": [[1], [0, 2, 1]], "SymInt[]": _SHAPES, "str": [], "number": [2.0]}
VARIED = {"dim", "getitem.b"}          # one form per candidate that runs
_LEFT_OUT = {"out", "generator", "memory_format", "layout", "device", "pin_memory", "requires_grad", "names",
             "inplace", "non_blocking", "copy", "_stacklevel", "_random_samples", "return_indices",
             "need_weights", "average_attn_weights", "mask", "key_padding_mask", "attn_mask", "is_causal",
             "scale", "enable_gqa", "dtype", "approximate", "rounding_mode"}


@dataclass(frozen=True)
class Param:
    name: str
    type: str              # TorchScript's spelling: Tensor, Tensor?, Tensor[], int, int[], Scalar ...
    required: bool
    kwarg_only: bool


@dataclass(frozen=True)
class Form:
    """One call: ``style`` torch / F / operator / method / module; ``args`` / ``kwargs`` hold values, a
    tensor as ``("T", recipe)`` and a list of them as ``("L", recipes)``; ``ctor``: a module's
    constructor keywords."""
    op: str
    style: str
    overload: str
    args: tuple
    kwargs: tuple
    ctor: tuple = ()
    callee: str = ""       # the attribute called (an in-place method's ``add_``)

    def __str__(self) -> str:
        show = lambda v: (v[1] if v[0] == "T" else "[" + ", ".join(v[1]) + "]") if _is_ref(v) else repr(v)
        args = [show(a) for a in self.args] + [f"{k}={show(v)}" for k, v in self.kwargs]
        fn = self.callee or self.op
        if self.style == "method":
            return f"{args[0]}.{fn}({', '.join(args[1:])})"
        if self.style == "module":
            return f"nn.{self.op}({', '.join(f'{k}={v!r}' for k, v in self.ctor)})({', '.join(args)})"
        return f"{self.style}.{fn}({', '.join(args)})"

    @property
    def ident(self) -> str:
        return f"{self.op}.{self.overload or 'py'}: {self}"


def _is_ref(v) -> bool:
    return isinstance(v, tuple) and len(v) == 2 and v[0] in ("T", "L") and \
        (isinstance(v[1], str) or (isinstance(v[1], tuple) and all(isinstance(x, str) for x in v[1])))


# -- signatures ------------------------------------------------------------------------------------
def _schema_params(schema) -> list[Param] | None:
    """A TorchScript schema's parameters, or None for an out= overload / one not taking a tensor first."""
    args = list(schema.arguments)
    if schema.overload_name.endswith("out") or any(a.alias_info is not None and a.alias_info.is_write
                                                   for a in args):
        return None
    operands = [a for a in args if str(a.type) != "str"]       # einsum's equation comes before its tensors
    if not operands or str(operands[0].type) not in ("Tensor", "Tensor[]", "List[Tensor]"):
        return None
    return [Param("input" if a.name == "self" else a.name, str(a.type).replace("List[Tensor]", "Tensor[]")
                  .replace("Optional[Tensor]", "Tensor?"), not a.has_default_value(), a.kwarg_only) for a in args]


def _py_type(annotation, default) -> str:
    text = str(annotation)
    if "Tensor" in text:
        return "Tensor?" if default is None else ("Tensor[]" if "list" in text.lower() else "Tensor")
    for word, kind in (("bool", "bool"), ("float", "float"), ("str", "str"), ("int", "int")):
        if word in text:
            return kind + ("[]" if "list" in text.lower() or "tuple" in text.lower() else "")
    return "any"


def _py_params(fn, skip: int = 0) -> list[Param] | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    out = []
    for p in list(sig.parameters.values())[skip:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        out.append(Param(p.name, _py_type(p.annotation, p.default if p.default is not p.empty else 0),
                         p.default is p.empty, p.kind == p.KEYWORD_ONLY))
    return out


def overloads(fn, name: str) -> list[tuple[str, list[Param]]]:
    """(overload name, parameters) of each of torch's signatures for ``fn`` (see *overloads*)."""
    found = get_signature_for_torch_op(fn, return_schemas=True) if fn is not None else (None, None)
    schemas = found[1] if found and found[1] else None
    if schemas is None and (fn is None or not inspect.isfunction(fn)):
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            schemas = [getattr(packet, o)._schema for o in packet.overloads()]
    if schemas:
        return [(s.overload_name or "default", p) for s in schemas if (p := _schema_params(s)) is not None]
    params = _py_params(fn) if fn is not None else None
    if fn is None and not params:        # a method torch gives no signature for (x.float()): self alone
        params = [Param("input", "Tensor", True, False)]
    return [("py", params)] if params else []


# -- values ----------------------------------------------------------------------------------------
def _candidates(p: Param, first: bool, op: str = "") -> list:
    base = p.type.rstrip("?")
    if base == "Tensor":
        order = TENSORS if first else ("g",) + tuple(t for t in TENSORS if t != "g")
        return [("T", t) for t in order]
    if base == "Tensor[]":
        return [("L", ("h", "g"))]
    named = VALUES.get(f"{op}.{p.name}", VALUES.get(p.name))
    if named is not None:
        return named
    if base == "any":            # a Python signature without annotations: a tensor, or a number
        return _candidates(Param(p.name, "Tensor", p.required, p.kwarg_only), first) + ([] if first else [2.0, 2])
    return BY_TYPE.get(base, BY_TYPE.get(base.split("(")[0], []))


def resolve(value, tensors: dict):
    if _is_ref(value):
        return tensors[value[1]]() if value[0] == "T" else [tensors[t]() for t in value[1]]
    return value


def call(form: Form, h, g, m):
    """Run ``form`` on the block ``m``'s tensors (eagerly or traced)."""
    tensors = _tensors(h, g, m)
    args = [resolve(a, tensors) for a in form.args]
    kwargs = {k: resolve(v, tensors) for k, v in form.kwargs}
    if form.style == "method":
        return getattr(args[0], form.callee or form.op)(*args[1:], **kwargs)
    if form.style == "module":
        return m.op(*args, **kwargs)
    space = {"torch": torch, "F": F, "operator": operator}[form.style]
    return getattr(space, form.callee or form.op)(*args, **kwargs)


def draws(form: Form) -> bool:
    """Does ``form`` draw random numbers (two seeds, two results)?  Such a form has no single-device
    reference to train against; it is planned only."""
    m, h, g = _probe()
    if form.style == "module":         # its parameters drawn once: the call is what may draw
        torch.manual_seed(0)
        m.op = getattr(nn, form.op)(**dict(form.ctor))
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            outs.append([t for t in _flat(call(form, h.clone(), g.clone(), m)) if isinstance(t, torch.Tensor)])
    return any(not torch.equal(a, b) for a, b in zip(*outs))


def trains(form: Form) -> bool:
    """Does the block around ``form`` train on one device: a forward, the loss and its backward run, to a
    finite loss and finite gradients?  A form that does not (``torch.pow(h, hb)``: no gradient through
    a bool exponent; ``torch.bernoulli(h, 0.0)``: no derivative) has no single-device reference to train
    against; it is planned only."""
    model = block(form)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, N, C, generator=g), torch.randint(0, CLASSES, (B,), generator=g)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss = F.cross_entropy(model(x), y)
            loss.backward()
    except Exception:                          # noqa: BLE001  (whatever torch refuses on one device)
        return False
    return bool(torch.isfinite(loss)) and all(p.grad is None or bool(torch.isfinite(p.grad).all())
                                              for p in model.parameters())


def _flat(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _finite(out) -> bool:
    if isinstance(out, torch.Tensor):
        return not out.is_floating_point() or bool(torch.isfinite(out).all())
    if isinstance(out, (tuple, list)):
        return all(_finite(o) for o in out)
    return isinstance(out, (int, float, bool, torch.Size))


_PROBE: list = []


def _probe():
    """The block's tensors for trying calls eagerly: (block, h, g), built once."""
    if not _PROBE:
        torch.manual_seed(0)
        m = FormBlock(Form("", "torch", "", (), ()))
        with torch.no_grad():
            t = m.norm(torch.randn(B, N, C))
            _PROBE.append((m, m.fc1(t), m.fc2(t)))
    return _PROBE[0]


def runs(form: Form) -> bool:
    """Does ``form`` run eagerly on the block's tensors, to finite values fit can use?"""
    m, h, g = _probe()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            if form.style == "module":
                m.op = getattr(nn, form.op)(**dict(form.ctor))
            out = call(form, h.clone(), g.clone(), m)
        return _finite(out) and fit_plan(out) is not None
    except Exception:                          # noqa: BLE001  (a combination torch refuses: try the next)
        return False


def _search(make, params: list[Param], varied: bool, op: str) -> list[Form]:
    """Forms made by ``make(values)`` for the first combination of candidates that runs; with ``varied``,
    one more form per other candidate of a VARIED parameter that runs."""
    lists = [_candidates(p, i == 0, op) for i, p in enumerate(params)]
    if any(not c for c in lists):
        return []
    for combo in itertools.islice(itertools.product(*lists), 600):
        form = make(combo)
        if runs(form):
            found = [form]
            for i, p in enumerate(params) if varied else ():
                if p.name in VARIED or f"{op}.{p.name}" in VARIED:
                    for alt in lists[i][1:]:
                        other = make(combo[:i] + (alt,) + combo[i + 1:])
                        if runs(other):
                            found.append(other)
            return found
    return []


def _callables(name: str):
    """(style, callable) for every spelling torch has of ``name`` (see *ops*)."""
    out = []
    for style, space in (("torch", torch), ("F", F), ("operator", operator)):
        fn = getattr(space, name, None)
        if callable(fn) and not inspect.isclass(fn):
            out.append((style, fn))
    if callable(getattr(torch.Tensor, name, None)):
        out.append(("method", getattr(torch, name, None) if callable(getattr(torch, name, None)) else None))
    cls = getattr(nn, name, None)
    if inspect.isclass(cls) and issubclass(cls, nn.Module):
        out.append(("module", cls))
    return out


def _call_forms(name: str, style: str, overload: str, params: list[Param]) -> list[Form]:
    given = [p for p in params if p.required or (p.name not in _LEFT_OUT and _candidates(p, False, name))]
    required = [p for p in params if p.required]
    forms = []

    def maker(ps, keyword: bool, callee: str = "", extra=()):
        def make(values):
            args, kwargs = [], []
            for i, (p, v) in enumerate(zip(ps, values)):
                if p.kwarg_only or (keyword and i > 0):
                    kwargs.append((p.name, v))
                else:
                    args.append(v)
            return Form(name, style, overload, tuple(args), tuple(kwargs) + extra, callee=callee)
        return make

    for ps, keyword in ((required, False), (given, False), (given, True)):
        forms += _search(maker(ps, keyword), ps, True, name)
    if style == "method" and callable(getattr(torch.Tensor, name + "_", None)):
        forms += _search(maker(required, False, name + "_"), required, False, name)
    if style == "F" and any(p.name == "inplace" for p in params):
        forms += _search(maker(required, False, extra=(("inplace", True),)), required, False, name)
    if style == "operator" and callable(getattr(operator, "i" + name, None)):
        forms += _search(maker(required, False, "i" + name), required, False, name)
    return forms


def _module_forms(name: str, cls) -> list[Form]:
    ctor = [p for p in (_py_params(cls.__init__, skip=1) or []) if p.required or p.name in VALUES]
    ctor = [p for p in ctor if p.name not in _LEFT_OUT]
    fwd = [p for p in (_py_params(cls.forward, skip=1) or []) if p.required]
    lists = [VALUES.get(p.name) or BY_TYPE.get(p.type, []) for p in ctor]
    if any(not c for c in lists):
        return []
    for values in itertools.islice(itertools.product(*lists), 50):
        kw = tuple((p.name, v) for p, v in zip(ctor, values))
        found = _search(lambda vals: Form(name, "module", "py", tuple(vals), (), kw), fwd, False, name)
        if found:
            return found
    return []


def generate(names=None) -> tuple[list[Form], list[tuple[str, str]]]:
    """Every form of the registry's ops (or of ``names`` alone; see the module docstring), and (op, why)
    for the spellings that gave none."""
    forms, skipped = [], []
    for name in OPS if names is None else names:
        spellings = _callables(name)
        if not spellings:
            skipped.append((name, "torch has no function, method or nn module of this name"))
            continue
        for style, fn in spellings:
            made = []
            if style == "module":
                made = _module_forms(name, fn)
            else:
                for overload, params in overloads(fn, name):
                    made += _call_forms(name, style, overload, params)
            if not made:
                skipped.append((name, f"{style}: no overload runs on the block's tensors with our values"))
            forms += made
    unique = {}
    for f in forms:
        unique.setdefault(str(f), f)
    return list(unique.values()), skipped


# -- the block -------------------------------------------------------------------------------------
def fit_plan(out):
    """How ``fit`` turns ``out`` into (B, N, H): ("tensor" or "pieces", per tensor (permutation, dims
    summed, dims unsqueezed, cast to float)); ("scalar", index) for a number or a shape; None when
    nothing fits.  Worked out eagerly: a traced call's result is a Proxy, which tells none of this."""
    if isinstance(out, (int, float)) and not isinstance(out, bool):
        return ("scalar", None)
    if isinstance(out, torch.Size):
        return ("scalar", len(out) - 1) if len(out) else None
    # of a tuple or list the first two: their count never depends on the batch (``h.unbind(0)``)
    pieces = [out] if isinstance(out, torch.Tensor) else list(out)[:2] if isinstance(out, (tuple, list)) else []
    plans = []
    for p in pieces:
        if not isinstance(p, torch.Tensor):
            return None
        role = {}
        for d, s in enumerate(p.shape):
            k = next((k for k, r in enumerate(ROLES) if r == s and k not in role.values()), None)
            if k is not None:
                role[d] = k
        kept = sorted(role, key=role.get)
        others = [d for d in range(p.dim()) if d not in role]
        missing = [k for k in range(3) if k not in role.values()]
        plans.append((others + kept, len(others), missing, p.dtype != DTYPE))
    if not plans:
        return None
    return ("tensor" if isinstance(out, torch.Tensor) else "pieces", plans)


def fit(out, g, plan):
    """``out`` fitted to (B, N, H) and added to ``g`` (see *fit*)."""
    if plan[0] == "scalar":
        return g * (out if plan[1] is None else out[plan[1]])
    pieces = [out] if plan[0] == "tensor" else [out[i] for i in range(len(plan[1]))]   # the first two
    acc = g
    for p, (perm, summed, missing, cast) in zip(pieces, plan[1]):
        if cast:
            p = p.to(g.dtype)
        if perm != list(range(len(perm))):
            p = p.permute(*perm)
        if summed:
            p = p.sum(dim=list(range(summed)))
        for k in missing:
            p = p.unsqueeze(k)
        acc = acc + p
    return acc


class FormBlock(nn.Module):
    """The block of the module docstring around ``form`` (its fit worked out eagerly on first build)."""

    def __init__(self, form: Form, plan=None):
        super().__init__()
        self.form = form
        self.norm = nn.LayerNorm(C)
        self.fc1, self.fc2, self.fc3 = nn.Linear(C, H), nn.Linear(C, H), nn.Linear(H, C)
        self.head = nn.Linear(C, CLASSES)
        self.w = nn.Parameter(torch.randn(H, H) * 0.3)
        self.b = nn.Parameter(torch.randn(H) * 0.3)
        self.register_buffer("idx", torch.tensor([1, 0]))                       # below any dim's size
        self.register_buffer("gidx", torch.arange(N * H).reshape(1, N, H) % 2)
        if form.style == "module":
            self.op = getattr(nn, form.op)(**dict(form.ctor))
        self.plan = plan

    def forward(self, x):                                        # (B, N, C)
        t = self.norm(x)
        h, g = self.fc1(t), self.fc2(t)                          # (B, N, H): split by H under tp
        y = fit(call(self.form, h, g, self), g, self.plan)       # (B, N, H)
        x = x + self.fc3(y)                                      # (B, N, C)
        return self.head(x.mean(1))                              # (B, CLASSES)


def block(form: Form) -> FormBlock:
    """The block around ``form``, its parameters drawn from seed 0 (the same on every rank)."""
    torch.manual_seed(0)
    probe = FormBlock(form)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = probe.norm(torch.randn(B, N, C))
        plan = fit_plan(call(form, probe.fc1(t).clone(), probe.fc2(t).clone(), probe))
    torch.manual_seed(0)
    return FormBlock(form, plan)


_FORMS: dict = {}


def forms(names=None) -> list[Form]:
    """``generate(names)``'s forms, made once per process (the ranks of a pool make them alike)."""
    key = None if names is None else tuple(names)
    if key not in _FORMS:
        _FORMS[key] = generate(names)[0]
    return _FORMS[key]


# -- run on every rank of a pool -------------------------------------------------------------------
TOL = 1e-5          # relative to a value's magnitude (at least 1), beyond float32's own error (``train_given``)


def train_forms(names, idents: list[str], steps: int = 2, lr: float = 0.1) -> dict:
    """``train_given`` of the forms ``idents`` (by ``Form.ident``, of ``forms(names)``)."""
    by_ident = {f.ident: f for f in forms(names)}
    return train_given([by_ident[i] for i in idents], steps, lr)


def _float64_training(model, xs, ys, lr):
    """One device's training of ``model`` in float64, or None where a form does not run in it."""
    from tests.dist_checks import reference_training
    try:
        return reference_training(copy.deepcopy(model).double(), xs.double(), ys, lr)
    except Exception:                          # noqa: BLE001  (an op without a float64 kernel)
        return None


def _off(got, ref, exact) -> float:
    """How far ``got`` is from ``ref`` (float32, one device), in tolerances: TOL times ``ref``'s
    magnitude (at least 1) plus four times float32's own error there (``ref`` against ``exact``, the
    float64 run)."""
    got, ref = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    own = 0.0 if exact is None else (ref - torch.as_tensor(exact, dtype=torch.float64)).abs().max().item()
    allowed = TOL * max(1.0, ref.abs().max().item()) + 4 * own
    return (got - ref).abs().max().item() / allowed


def train_given(given: list[Form], steps: int = 2, lr: float = 0.1) -> dict:
    """Each form at mesh (1, 2, 1) against one device: ``{ident: (loss off, param off)}``, the largest
    of the losses' and of the parameter tensors' ``_off`` (equal: at most 1), or ``{ident: "PlanError:
    ..."}`` where planning refused it.  Why float32's own error counts: a form may make large values
    whose rounding, summed in another order on split ranks, differs by more than TOL although the two
    agree as closely as one device's float32 run agrees with its float64 run (``torch.reciprocal(h)``
    of an ``h`` near zero: losses of 72 and parameters of 262 after two steps, float32 off float64 by
    3e-3 and 1e-2; ``h / g``: a parameter off by 4e-5 in one of magnitude 3.5)."""
    from autosplit.errors import PlanError
    from tests.dist_checks import reference_training, train_steps
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(steps, B, N, C, generator=g), torch.randint(0, CLASSES, (steps, B), generator=g)
    out = {}
    for form in given:
        model = block(form)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_losses, ref_state = reference_training(model, xs, ys, lr)
            exact_losses, exact_state = _float64_training(model, xs, ys, lr) or (None, {})
            try:
                pm = autosplit.parallelize(model, mesh=(1, 2, 1), loss_fn=nn.CrossEntropyLoss(),
                                           num_microbatches=1, example_input=xs[0])
            except PlanError as exc:
                out[form.ident] = f"PlanError: {exc}"
                continue
            losses = train_steps(pm, torch.optim.SGD(pm.parameters(), lr=lr), xs, ys, slice(None))
            state = pm.full_state_dict()
            pm.close()
        out[form.ident] = (_off(losses, ref_losses, exact_losses),
                           max(_off(state[k], ref_state[k], exact_state.get(k)) for k in ref_state))
    dist.barrier()
    return out
