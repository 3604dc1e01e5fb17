"""One name per idea across the API and the CLI (issue 48, item 4); the old spellings for one release.

Each rename: the new name works, and the old one gives the same result with a warning naming the new one
(a DeprecationWarning pointing at the caller's line for API keywords; a stderr line for CLI flags;
autosplit/deprecated.py).  Fast: ``compile`` on tiny models, the CLI's parser and ``main``; ``parallelize``
only up to its checks before any rendezvous.
"""
from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import autosplit
from autosplit.__main__ import _parser, main
from autosplit.cli_options import plan_options
from autosplit.errors import AutosplitError
from autosplit.options import PlanOptions
from tests.models import VARIANTS, timm_cls, tp_timm

X = torch.randn(4, 3, 32, 32)


def _call(fn, raises: str | None):
    if raises is None:
        return fn()
    with pytest.raises(AutosplitError, match=raises):
        fn()


def _deprecated(fn, *names, raises: str | None = None):
    """``fn()``'s result; it must warn once, a DeprecationWarning at this file naming every one of ``names``
    (and raise an AutosplitError matching ``raises`` where given: parallelize, stopped before a rendezvous)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _call(fn, raises)
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert ours[0].filename == __file__, (ours[0].filename, str(ours[0].message))   # the user's line
    assert all(n in str(ours[0].message) for n in names), str(ours[0].message)
    return result


def _quiet(fn, raises: str | None = None):
    """``fn()``'s result; it must not warn about a deprecation."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        return _call(fn, raises)


# ---- 1. recompute= (was checkpoint=) ------------------------------------------------------------

def test_compile_recompute_and_its_old_spelling():
    new = _quiet(lambda: autosplit.compile(tp_timm(), mesh=(2, 1, 1), example_input=X, recompute="block"))
    old = _deprecated(lambda: autosplit.compile(tp_timm(), mesh=(2, 1, 1), example_input=X, checkpoint="block"),
                      "checkpoint", "recompute=")
    assert new.recompute == old.recompute == "block"
    assert new.summary() == old.summary() and "recompute=block" in new.summary()
    assert new.to_dict()["recompute"] == "block" and "checkpoint" not in new.to_dict()
    with pytest.raises(AutosplitError, match="both recompute= and its deprecated spelling checkpoint="):
        autosplit.compile(tp_timm(), mesh=(2, 1, 1), example_input=X, recompute="block", checkpoint="stage")


def test_plan_options_recompute_and_its_old_spelling():
    assert "recompute" in PlanOptions.names() and "checkpoint" not in PlanOptions.names()
    old = _deprecated(lambda: PlanOptions(checkpoint="stage"), "PlanOptions(checkpoint=", "recompute=")
    assert old == PlanOptions(recompute="stage")
    with pytest.raises(AutosplitError, match="both recompute= and"):
        PlanOptions(recompute="stage", checkpoint="block")
    by_options = autosplit.compile(tp_timm(), mesh=(2, 1, 1), example_input=X, options=old)
    assert by_options.recompute == "stage"


def test_parallelize_takes_recompute_and_warns_for_checkpoint():
    """Up to its checks before any rendezvous: the options parse (the old keyword warns), then dp_shard is refused."""
    _quiet(lambda: autosplit.parallelize(tp_timm(), mesh=(1, 1, 1), recompute="stage", dp_shard="rows"),
           raises="dp_shard='rows'")
    _deprecated(lambda: autosplit.parallelize(tp_timm(), mesh=(1, 1, 1), checkpoint="stage", dp_shard="rows"),
                "parallelize(checkpoint=", "recompute=", raises="dp_shard='rows'")
    with pytest.raises(AutosplitError, match="parallelize\\(\\) got unknown option 'recompte'"):
        autosplit.parallelize(tp_timm(), mesh=(1, 1, 1), recompte="stage")


def test_search_candidates_say_recompute_and_still_read_checkpoint():
    ranked = autosplit.search(VARIANTS["timm_cls"](), 2, torch.empty(1, 3, 32, 32), global_batch=8, device="h100",
                              top=3)
    c = ranked[0]
    assert "recompute" in c.options and "checkpoint" not in dict(c.options)
    assert _deprecated(lambda: c.options["checkpoint"], "options['checkpoint']", "options['recompute']") \
        == c.options["recompute"]
    assert _deprecated(lambda: c.options.get("checkpoint"), "recompute") == c.options["recompute"]
    assert "ckpt=" not in ranked.table()


def test_cli_recompute_and_its_old_flag(capsys):
    new = _parser().parse_args(["plan", "m", "--recompute", "block"])
    assert capsys.readouterr().err == ""
    old = _parser().parse_args(["plan", "m", "--checkpoint", "block"])
    err = capsys.readouterr().err
    assert "--checkpoint is deprecated" in err and "use --recompute" in err
    assert plan_options(new) == plan_options(old) == PlanOptions(recompute="block")


# ---- 2. --microbatch / --global-batch ------------------------------------------------------------

def test_plan_microbatch_and_its_contract_alias_batch(capsys):
    """``plan --batch N`` is the contract's: the same as --microbatch N, without a warning."""
    a = _parser().parse_args(["plan", "m", "--microbatch", "4"])
    b = _parser().parse_args(["plan", "m", "--batch", "4"])
    assert a.microbatch == b.microbatch == 4 and capsys.readouterr().err == ""
    assert main(["plan", "tests.models:tp_timm", "--mesh", "2,1,1", "--microbatch", "2"]) == 0
    first = capsys.readouterr().out
    assert main(["plan", "tests.models:tp_timm", "--mesh", "2,1,1", "--batch", "2"]) == 0
    second = capsys.readouterr()
    assert second.err == "" and "microbatches of [2x3x32x32]" in first
    assert first.split("planned in")[0] == second.out.split("planned in")[0]


def test_search_global_batch_and_memory_budget_and_their_old_flags(capsys):
    new = _parser().parse_args(["search", "m", "--world", "4", "--global-batch", "16", "--memory-budget", "1GiB"])
    assert capsys.readouterr().err == ""
    old = _parser().parse_args(["search", "m", "--world", "4", "--batch", "16", "--memory", "1GiB"])
    err = capsys.readouterr().err
    assert "--batch is deprecated" in err and "use --global-batch" in err
    assert "--memory is deprecated" in err and "use --memory-budget" in err
    assert (new.global_batch, new.memory_budget) == (old.global_batch, old.memory_budget) == (16, "1GiB")
    with pytest.raises(SystemExit):        # still required, under either spelling
        _parser().parse_args(["search", "m", "--world", "4"])
    assert "--global-batch" in capsys.readouterr().err


# ---- 4. dp_shard ------------------------------------------------------------------------------------

def test_dp_shard_auto_is_true():
    auto = _quiet(lambda: autosplit.compile(tp_timm(), mesh=(1, 1, 2), example_input=X, dp_shard="auto"))
    true = _quiet(lambda: autosplit.compile(tp_timm(), mesh=(1, 1, 2), example_input=X, dp_shard=True))
    assert auto.summary() == true.summary() and auto.dp_shard in ("stage", "layer")
    assert PlanOptions(dp_shard="auto") == PlanOptions(dp_shard=True)
    args = _parser().parse_args(["plan", "m", "--dp-shard", "auto"])
    assert plan_options(args).dp_shard is True
    assert {a.dest: a for a in _plan_actions()}["dp_shard"].choices == ["auto", "layer", "off", "stage"]
    with pytest.raises(AutosplitError, match=r"dp_shard='rows': expected False, 'stage', 'layer' or 'auto'"):
        autosplit.compile(tp_timm(), mesh=(1, 1, 2), example_input=X, dp_shard="rows")


def _plan_actions():
    import argparse
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["plan"]._actions


# ---- 5. --num-microbatches (was --microbatches) ------------------------------------------------

def test_cli_num_microbatches_and_its_old_flag(capsys):
    new = _parser().parse_args(["plan", "m", "--num-microbatches", "6"])
    assert capsys.readouterr().err == ""
    old = _parser().parse_args(["plan", "m", "--microbatches", "6"])
    err = capsys.readouterr().err
    assert "--microbatches is deprecated" in err and "use --num-microbatches" in err
    assert new.num_microbatches == old.num_microbatches == 6


# ---- 6. --autocast: one spelling for plan and search -------------------------------------------

def test_autocast_flag():
    assert _parser().parse_args(["plan", "m", "--autocast", "bf16"]).autocast == "bf16"
    assert _parser().parse_args(["search", "m", "--world", "2", "--global-batch", "8", "--autocast", "bf16"]
                                ).autocast == "bf16"
    assert _parser().parse_args(["search", "m", "--world", "2", "--global-batch", "8"]).autocast is None


# ---- 7. autosplit profile --ranks N (was python -m autosplit.profiling.measure_profile) ---------

@pytest.fixture
def fake_local_world(monkeypatch, tmp_path):
    """``measure_here`` replaced by one returning a datasheet profile: the calls it got."""
    import dataclasses

    from autosplit.cost_model import get_profile
    from autosplit.profiling import measure_profile
    calls = []

    def measure_here(ranks, threads=1, timeout=300.0):
        calls.append((ranks, threads))
        return dataclasses.replace(get_profile("h100"), name="fake local world")
    monkeypatch.setattr(measure_profile, "measure_here", measure_here)
    monkeypatch.setenv("AUTOSPLIT_PROFILE_DIR", str(tmp_path))
    return calls


def test_profile_ranks_spawns_the_local_world(fake_local_world, capsys, tmp_path):
    from autosplit.cost_model import profile_file
    assert main(["profile", "--ranks", "3", "--threads", "2"]) == 0
    assert fake_local_world == [(3, 2)]
    out = capsys.readouterr().out
    assert "fake local world" in out and ("cached in" in out or "not cached" in out)
    path = tmp_path / "local.json"
    assert main(["profile", "--ranks", "2", "--out", str(path)]) == 0
    assert fake_local_world[-1] == (2, 1) and profile_file.read(path).name == "fake local world"


@pytest.mark.parametrize("argv,error", [
    (["profile"], "--out FILE.json is needed"),
    (["profile", "--ranks", "0"], "--ranks 0: expected a positive number"),
    (["profile", "--ranks", "2", "--threads", "0"], "--threads 0: expected a positive number"),
    (["profile", "--ranks", "2", "--seconds", "1"], "--seconds applies to"),
    (["profile", "--out", "p.json", "--seconds", "0"], "--seconds 0.0: expected a positive number"),
])
def test_profile_refuses_bad_flags_before_measuring(fake_local_world, capsys, argv, error):
    assert main(argv) == 2
    assert error in capsys.readouterr().err and fake_local_world == []


def test_old_measure_profile_entry_point_warns_and_does_the_same(fake_local_world, capsys):
    from autosplit.profiling.measure_profile import main as old_main
    old_main(["--ranks", "3", "--threads", "2"])
    captured = capsys.readouterr()
    assert fake_local_world == [(3, 2)] and "fake local world" in captured.out
    assert "python -m autosplit.profiling.measure_profile --ranks N is deprecated" in captured.err
    assert "use python -m autosplit profile --ranks 3 --threads 2" in captured.err


# ---- 8. plan.balance(): None, not "n/a" ---------------------------------------------------------

def test_balance_baseline_is_none_without_a_cut():
    """Fewer layers (embedding and head included) than stages: torchtitan's rule has no cut."""
    plan = autosplit.compile(timm_cls(depth=2), mesh=(6, 1, 1), example_input=torch.randn(2, 3, 32, 32))
    ours, base = plan.balance()
    assert isinstance(ours, float) and base is None
    assert "vs n/a torchtitan's cut" in plan.summary() and plan.to_dict()["balance"]["equal_layer_count"] is None


# ---- 9. compile and parallelize: one signature shape ---------------------------------------------

def _keyword_only(fn) -> list[str]:
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]


def test_compile_and_parallelize_share_keyword_order_and_defaults():
    """The options are keyword-only in PlanOptions' order in both (parallelize's num_microbatches stays
    positional, as the contract shows); a shared argument has one default, except device (offline
    compile plans for "h100"; parallelize for the device it runs on) and mesh (parallelize's dp=-1
    takes the world, which compile does not have)."""
    options = PlanOptions.names()
    assert _keyword_only(autosplit.compile) == options + ["options"]
    assert _keyword_only(autosplit.parallelize)[:len(options)] == [o for o in options if o != "num_microbatches"] \
        + ["options"]
    c, p = (inspect.signature(f).parameters for f in (autosplit.compile, autosplit.parallelize))
    assert list(c)[:3] == ["model", "mesh", "example_input"]
    assert list(p)[:4] == ["model", "mesh", "loss_fn", "num_microbatches"]
    for name in set(c) & set(p) - {"device", "mesh", "old_positional"}:
        assert c[name].default == p[name].default, name
    assert c["num_microbatches"].default is None is p["num_microbatches"].default      # None: 2 * pp in both
    assert c["device"].default == "h100" and p["device"].default is None


def test_old_positional_options_warn_and_mean_the_same():
    by_keyword = autosplit.compile(tp_timm(), (2, 1, 1), X, tp_mode="1d", schedule="gpipe", chunks_per_rank=1,
                                   num_microbatches=2)
    positional = _deprecated(lambda: autosplit.compile(tp_timm(), (2, 1, 1), X, "1d", "gpipe", 1, 2),
                             "tp_mode, schedule, chunks_per_rank, num_microbatches", "compile()", "num_microbatches=")
    assert positional.summary() == by_keyword.summary()
    with pytest.raises(AutosplitError, match="multiple values for schedule"):
        autosplit.compile(tp_timm(), (2, 1, 1), X, "1d", "gpipe", schedule="interleaved")
    with pytest.raises(AutosplitError, match="at most 4 positional arguments"):
        autosplit.compile(tp_timm(), (2, 1, 1), X, "1d", "gpipe", 1, 2, 5)
    _deprecated(lambda: autosplit.parallelize(tp_timm(), (1, 1, 1), None, 2, "gpipe", dp_shard="rows"),
                "passing schedule to parallelize() positionally", "schedule=", raises="dp_shard='rows'")
