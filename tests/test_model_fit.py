"""cost_model/model_fit.py: a measured profile rescaled so that the cost model's passes equal the model's
own forward and backward times at the two sizes it timed; the user's model is not touched."""
from __future__ import annotations

import pytest
import torch

import autosplit
from autosplit.cost_model import H100
from autosplit.cost_model.model_fit import _predicted_parts, _solve, fit_to_model
from autosplit.errors import AutosplitError
from tests.models import HandViT, tp_timm
from tests.test_measured_profile import CPU


def test_solve_recovers_both_scales_and_falls_back_to_one():
    pred = ((2.0, 10.0), (2.0, 40.0))                    # (constants, work) at two sizes
    meas = (3.0 * 2.0 + 0.5 * 10.0, 3.0 * 2.0 + 0.5 * 40.0)
    assert _solve(pred, meas) == (3.0, 0.5)
    ka, kw = _solve(pred, (10.0, 10.0))                  # the exact solution has k_work < 0: one factor
    assert ka == kw == 20.0 / 54.0


def _passes(gm_factory, profile, b: int) -> tuple[float, float]:
    from autosplit.cost_model.annotate import AnnotateCosts
    from autosplit.passes.shape_prop import MetaShapeProp
    from autosplit.trace import trace
    inputs = (torch.randn(b, 3, 32, 32),)
    gm = trace(gm_factory, 1)
    MetaShapeProp(inputs)(gm)
    AnnotateCosts()(gm)
    parts = tuple(a + w for a, w in _predicted_parts(gm, profile).values())
    # compile's own pricing of the same nodes (roofline.graph_time) agrees with the fit's decomposition
    from autosplit.cost_model.roofline import graph_time
    priced = graph_time(gm.graph.nodes, profile)
    assert all(abs(p - q) <= 1e-9 * q for p, q in zip(parts, priced)), (parts, priced)
    return parts


def test_fitted_profile_predicts_the_timed_passes():
    """Both sizes, both passes: the fitted profile's sums equal what was timed (or, where one factor was
    used, their totals do) -- on a model the fit never saw in its own pricing code, and on a meta model."""
    for model, meta in ((tp_timm(), False), (HandViT(), False)):
        fitted, fit = fit_to_model(CPU, model, torch.empty(1, 3, 32, 32), sizes=(2, 4), reps=2, budget=0.0)
        assert fit is not None and fitted.name.startswith(CPU.name) and "fitted to the model" in fitted.name
        got = [_passes(model, fitted, b) for b in fit.sizes]
        for k, key in enumerate(("fwd", "bwd")):
            ka, kw = fit.scales[key]
            pairs = [(got[i][k], fit.measured[key][i]) for i in range(2)]
            if ka != kw:
                assert all(abs(p - m) <= 1e-9 * m for p, m in pairs), (key, pairs)
            else:
                assert abs(sum(p for p, _ in pairs) - sum(m for _, m in pairs)) <= 1e-9 * sum(m for _, m in pairs)
    with torch.device("meta"):
        meta_model = tp_timm()
    fitted, fit = fit_to_model(CPU, meta_model, torch.empty(1, 3, 32, 32, device="meta"), sizes=(2, 4), reps=2,
                               budget=0.0)
    assert fit.measured["fwd"][0] > 0 and all(p.device.type == "meta" for p in meta_model.parameters())
    plan = autosplit.compile(tp_timm(), mesh=(2, 1, 1), example_input=torch.randn(2, 3, 32, 32), device=fitted)
    assert plan.stages[0].fwd_time > 0


def test_model_untouched_and_datasheet_profiles_unchanged():
    model = tp_timm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit_to_model(CPU, model, torch.empty(1, 3, 32, 32), sizes=(2, 4), reps=2, budget=0.0)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    if not torch.cuda.is_available():                  # a GPU profile is fitted only where a GPU is
        assert fit_to_model(H100, model, torch.empty(1, 3, 32, 32)) == (H100, None)


def test_roofline_profile_fitted_on_the_cpu_predicts_the_timed_passes():
    """A roofline profile (no per-class fits: a datasheet or calibrate()'s peaks) is fitted with one pair
    for the whole pass: op_overhead * k_alpha, peaks and bandwidth / k_work.  The fitted profile's
    forward + backward sums then equal the timed totals at both sizes (or their sum, where one factor was
    used); a GPU profile is refused on the CPU, and comes back unchanged where no GPU is present."""
    import dataclasses
    roofline = dataclasses.replace(H100, name="roofline (test)", device_type="cpu", peak_flops={
        torch.float32: 5e10, torch.bfloat16: 5e10}, mem_bandwidth=1e10, op_overhead=2e-6)
    model = tp_timm()
    fitted, fit = fit_to_model(roofline, model, torch.empty(1, 3, 32, 32), sizes=(2, 4), reps=2, budget=0.0)
    assert fitted.compute is None and set(fit.scales) == {"pass"} and "fitted to the model" in fitted.name
    ka, kw = fit.scales["pass"]
    assert fitted.op_overhead == roofline.op_overhead * ka and fitted.mem_bandwidth == roofline.mem_bandwidth / kw
    got = [sum(_passes(model, fitted, b)) for b in fit.sizes]
    timed = [fit.measured["fwd"][i] + fit.measured["bwd"][i] for i in range(2)]
    if ka != kw:
        assert all(abs(g - t) <= 1e-9 * t for g, t in zip(got, timed)), (got, timed)
    else:
        assert abs(sum(got) - sum(timed)) <= 1e-9 * sum(timed)
    with pytest.raises(AutosplitError, match="is for a cuda device, but device='cpu'"):
        fit_to_model(H100, model, torch.empty(1, 3, 32, 32), device="cpu")
    if not torch.cuda.is_available():
        assert fit_to_model(H100, model, torch.empty(1, 3, 32, 32)) == (H100, None)
