"""Call forms of the ops the registry names, at tp = 2: each plans and trains equal to one device, or
planning refuses it with a PlanError naming it (issue 50, item 2).  Two tests do this, both slow: the
sample (one form per rule trained) and every form (all ~1,000 planned, one trainable form per op
trained: about 10 minutes on the shared 2 cores).  What the every-form test found on its first run
has tests of its own (the end of this file).

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
  sample    -- the sampled test's forms: for each sharding rule the registry names (``shard``), the
               forms of the first op declared with it, and of each op whose entry depends on the overload
               (``other``: binary ``torch.max(a, b)`` beside ``x.max(dim)``).
  refused   -- a PlanError (or, for a call torch cannot run on meta tensors, shape propagation's
               AutosplitError) whose message names the form's node (its op's name).
  trainable -- planned, draws no random numbers (``draws``) and trains on one device (``trains``: a
               forward and backward to finite values; ``torch.pow(h, hb)`` has no gradient through its
               bool exponent): a form with a single-device reference to train equal to.
  equal     -- losses and parameters after two SGD steps agree to 1e-5 relative to their magnitudes,
               beyond float32's own error there (one device's float32 run against its float64 run:
               ``train_given``).
"""
from __future__ import annotations

import collections
import warnings

import pytest
import torch

import autosplit
from autosplit.errors import AutosplitError
from autosplit.passes.op_registry import OPS
from tests.checks_op_forms import (B, C, N, Form, _callables, block, draws, generate, train_forms, train_given,
                                   trains)


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


def trainable(form, outcomes) -> bool:
    """See *trainable*."""
    return outcomes[form.ident] == "planned" and not draws(form) and trains(form)


def first_per(key, forms, outcomes) -> list:
    """The first trainable form of each ``key(form)``."""
    seen, out = set(), []
    for f in forms:
        if key(f) not in seen and trainable(f, outcomes):
            seen.add(key(f))
            out.append(f)
    return out


def one_per_rule(forms, outcomes) -> list:
    """The first trainable form of each sharding rule (opaque included): what the sample trains."""
    return first_per(lambda f: OPS[f.op].shard, forms, outcomes)


def one_per_op(forms, outcomes) -> list:
    """The first trainable form of each op: what the every-form test trains (training all ~1,000 would
    take over an hour: forms of one op share its rule and lowering, and differ in how the arguments
    are spelled, which planning reads)."""
    return first_per(lambda f: f.op, forms, outcomes)


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
    bad = {k: v for k, v in results[0].items() if isinstance(v, str) or max(v) > 1}
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


@pytest.mark.slow      # ~1,000 plans and ~155 trainings: ~10 min on the shared 2 cores
def test_every_form_plans_or_is_refused_by_name_and_one_per_op_trains_equal(pool2):
    """Every form plans or is refused by a PlanError naming its node; the first trainable form of every
    op trains equal to one device."""
    forms, skipped = generate()
    print(f"\nspellings without a form: {len(skipped)}")
    for name, why in skipped:
        print(f"  {name}: {why}")
    outcomes = plan_all(forms)
    trained = one_per_op(forms, outcomes)
    untrained = sorted({f.op for f in forms} - {f.op for f in trained})
    print(f"ops without a trainable form (planned only): {untrained}")
    print(f"trained equal to one device: {train_all(pool2, None, trained)}")


# -- what the every-form test found on its first run ----------------------------------------------
# A Tensor method's in-place form (``x.fill_(v)``) on a split operand that its op needs whole: the op has
# no sharding rule, so its operand is gathered, and the write goes to the gathered copy.
IN_PLACE = [Form("zero", "method", "py", (("T", "h"),), (), callee="zero_"),
            Form("fill", "method", "py", (("T", "h"), 0.5), (), callee="fill_"),
            Form("uniform", "method", "py", (("T", "h"), 0.5, 0.5), (), callee="uniform_"),
            Form("bernoulli", "method", "p", (("T", "h"), 0.0), (), callee="bernoulli_")]
# the forms of the first run that failed: a float64 result (h.double()), results of large magnitude
# (1 / h, h / g, g * h.numel()), and forms with no gradient on one device (torch.pow(h, hb))
FIRST_RUN = ["double", "reciprocal", "truediv", "div", "numel", "pow", "bernoulli"]
# module forms it took for random (``draws`` drew the module's parameters under each seed) and trained none
MODULES = ["Linear", "Conv1d", "MultiheadAttention"]


def test_a_result_of_another_dtype_is_fitted_to_the_blocks():
    """``h.double()`` gives a float64 result: fit casts it back (the block ran on no device before)."""
    forms = generate(["double", "half"])[0]
    assert forms
    for f in forms:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert block(f)(torch.randn(B, N, C)).dtype == torch.float32, f


def test_a_form_without_a_gradient_on_one_device_is_not_trained():
    """A form whose backward fails on one device has no reference to train equal to."""
    h = ("T", "h")
    assert not trains(Form("pow", "torch", "Tensor_Tensor", (h, ("T", "hb")), ()))  # no gradient through a bool
    assert not trains(Form("bernoulli", "torch", "p", (h, 0.0), ()))                # no derivative at all
    assert trains(Form("pow", "torch", "Tensor_Scalar", (h, 2.0), ()))
    assert trains(IN_PLACE[-1])                       # x.bernoulli_(p) overwrites x: its gradient is zero


def test_a_module_form_draws_only_where_its_call_draws():
    """A module's parameters are drawn once; the call itself is what ``draws`` asks about."""
    forms = generate(MODULES + ["rand_like"])[0]
    assert {f.op for f in forms if not draws(f)} == set(MODULES)
    assert all(draws(f) for f in forms if f.op == "rand_like")


@pytest.mark.parametrize("form", IN_PLACE, ids=lambda f: f.callee)
def test_an_in_place_op_without_a_rule_plans_on_a_split_operand(form):
    """The op keeps its own name and writes a copy of the gathered operand: the lowering spelled it out of
    place, and ``x.zero()``, ``x.fill(v)``, ``x.uniform()`` are no ops (planning failed in shape
    propagation with an AttributeError); ``x.bernoulli(p)`` is another op (the slow test below)."""
    assert plan_outcome(form) == "planned"


@pytest.mark.slow      # ~45 plans and 13 trainings: ~1 min on the shared 2 cores
def test_what_the_first_every_form_run_failed_or_left_untrained_trains_equal(pool2):
    """The first trainable form of each op of FIRST_RUN and MODULES, and the in-place forms without a
    rule (the copy ``x.bernoulli(p)`` of ``x.bernoulli_(p)`` has no derivative: training failed), equal
    to one device."""
    forms = generate(FIRST_RUN + MODULES)[0]
    outcomes = {f.ident: plan_outcome(f) for f in forms}
    trained = one_per_op(forms, outcomes)
    assert {f.op for f in trained} == set(FIRST_RUN + MODULES)
    assert "h.bernoulli_(0.0)" in {str(f) for f in trained}
    results = pool2.run(train_given, trained + IN_PLACE[:-1], timeout=1200)[0]
    bad = {k: v for k, v in results.items() if isinstance(v, str) or max(v) > 1}
    assert not bad, bad
