"""Call forms of the ops the registry names, at tp = 2: each plans and trains equal to one device, or
planning refuses it with a PlanError naming it (issue 50, item 2).  Here the sample (below); all
~1,000 forms were planned by a script this way (about 995 plan, 17 refused by name), and their test,
which also trained one form per op, failed in its training part and is not yet in the suite.

How the forms are generated (tests/checks_op_forms.py, whose docstring has the details): from the
registry's declarations (every name in passes/op_registry.py ``OPS`` that torch spells as a function,
``torch.nn.functional`` function, operator, Tensor method or ``torch.nn`` module) and torch's own
signatures for each spelling (``torch.fx.operator_schemas.get_signature_for_torch_op``'s schemas, the
``torch.ops.aten`` overload packet for a method-only op, ``inspect.signature`` for a Python function):
per overload the required arguments alone, every argument positionally, every argument by keyword,
as a function and as a method, and the in-place spellings; each argument's value is the first of a
small table of candidates (by name, then by type) for which the call runs eagerly.  No form is listed
by hand.  Each form sits in a small ViT-like block (tests/checks_op_forms.py ``FormBlock``) between
linears that tp = 2 splits, so the form sees split operands.

Terms:
  sample    -- the forms of the default tier: for each sharding rule the registry names (``shard``), the
               forms of the first op declared with it, and of each op whose entry depends on the overload
               (``other``: binary ``torch.max(a, b)`` beside ``x.max(dim)``).
  refused   -- a PlanError (or, for a call torch cannot run on meta tensors, shape propagation's
               AutosplitError) whose message names the form's node (its op's name).
"""
from __future__ import annotations

import collections
import warnings

import pytest
import torch

import autosplit
from autosplit.errors import AutosplitError
from autosplit.passes.op_registry import OPS
from tests.checks_op_forms import B, C, N, _callables, block, draws, generate, train_forms

TOL = 1e-5


def sample_ops() -> list[str]:
    """See *sample*."""
    first = {}
    for name, entry in OPS.items():
        first.setdefault(entry.shard, name)
    return sorted(set(first.values()) | {name for name, e in OPS.items() if e.other})


def sample(forms) -> list:
    """Of each op, its first form per overload (the default tier's planning budget: a few seconds)."""
    seen, out = set(), []
    for f in forms:
        key = (f.op, f.overload)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out


def one_per_rule(forms, outcomes) -> list:
    """The first planned, deterministic form of each sharding rule (opaque included): what the default
    tier trains."""
    seen, out = set(), []
    for f in forms:
        if OPS[f.op].shard not in seen and outcomes[f.ident] == "planned" and not draws(f):
            seen.add(OPS[f.op].shard)
            out.append(f)
    return out


def plan_outcome(form) -> str:
    """"planned", or "refused: <message>" for an AutosplitError (a PlanError, or shape propagation's
    error for the example input) naming the form's node; any other error is raised."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            autosplit.compile(block(form), mesh=(1, 2, 1), example_input=torch.randn(B, N, C), device="cpu")
        except AutosplitError as exc:
            named = form.op in str(exc) or (form.callee and form.callee in str(exc))
            assert named, f"{form}: refused without naming it: {exc}"
            return f"refused: {type(exc).__name__}: {exc}"
    return "planned"


def _reason(message: str) -> str:
    """A refusal's reason without the node's name (for grouping)."""
    text = message.removeprefix("refused: ")
    return text.split(") in module", 1)[-1].split(": ", 1)[-1][:100]


def plan_all(forms) -> dict:
    """{ident: outcome} for ``forms``, with the counts and the refusals grouped by reason printed."""
    outcomes = {f.ident: plan_outcome(f) for f in forms}
    refused = collections.Counter(_reason(v) for v in outcomes.values() if v != "planned")
    print(f"\n{len(forms)} forms: {sum(v == 'planned' for v in outcomes.values())} planned, "
          f"{sum(refused.values())} refused by name")
    for why, count in refused.most_common():
        print(f"  {count:4d}  {why}")
    return outcomes


def train_all(pool, names, forms) -> int:
    """Train ``forms`` (of ``generate(names)``) at (1, 2, 1) in one pool task; each equal to one device."""
    results = pool.run(train_forms, names, [f.ident for f in forms], timeout=7200)
    bad = {k: v for k, v in results[0].items() if isinstance(v, str) or max(v) > TOL}
    assert not bad, bad
    return len(forms)


def test_the_sample_covers_every_rule_and_spelling():
    """Every sharding rule the registry names has forms in the sample (where torch spells its first op),
    binary and reducing max among them, by function and method, positionally and by keyword."""
    names = sample_ops()
    forms = sample(generate(names)[0])
    spelled = {OPS[n].shard for n in names if _callables(n)}
    assert {OPS[f.op].shard for f in forms} == spelled
    every = generate(["max"])[0]
    kinds = {(f.style, bool(f.kwargs), f.overload) for f in every}
    assert {"other", "dim"} <= {o for _, _, o in kinds} and {True, False} == {k for _, k, _ in kinds}
    assert {"torch", "method"} <= {s for s, _, _ in kinds}
    assert {"other", "dim"} <= {f.overload for f in forms if f.op == "max"}


@pytest.mark.slow      # 41 plans + 23 trainings: ~3 min on the shared 2 cores, over the default tier's budget
def test_sampled_forms_plan_or_are_refused_by_name_and_one_per_rule_trains_equal(pool2):
    names = sample_ops()
    forms = sample(generate(names)[0])
    outcomes = plan_all(forms)
    refused = {k: v for k, v in outcomes.items() if v != "planned"}
    assert all(k.startswith("where.default") for k in refused), refused   # torch.where(x): nonzero, data-dependent
    print(f"trained equal to one device: {train_all(pool2, names, one_per_rule(forms, outcomes))}")
