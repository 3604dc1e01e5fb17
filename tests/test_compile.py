"""autosplit.compile: chained stages equal the model; plans are balanced, inspectable and validated."""
import argparse
import copy
import json

import pytest
import timm
import torch

import autosplit
from autosplit.errors import AutosplitError, TraceError
from autosplit.options import PlanOptions
from tests.models import VARIANTS, HandViT, timm_cls


def run_chain(plan, x):
    """Run every stage in global stage order, the way the pipeline runtime hands tensors on."""
    values = (x,)
    for s in range(plan.n_stages):
        pp_rank, chunk = s % plan.mesh.pp, s // plan.mesh.pp
        values = plan.stage_modules(pp_rank)[chunk](*values)
        assert isinstance(values, tuple)
    assert len(values) == 1, "the last stage returns the model's output as a 1-tuple"
    return values[0]


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("pp,chunks", [(2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (4, 2)])
@pytest.mark.default_cases('2-1-hand', '3-1-tp_torchvision', '4-1-tp_timm', '2-2-timm_cls', '3-2-tp_swiglu',
                           '4-2-timm_reg_qknorm_ls', '4-2-torchvision')     # each stage count and chunking once
def test_chained_stages_equal_model(name, pp, chunks):
    torch.manual_seed(0)
    model = VARIANTS[name]()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 3, 32, 32)
    schedule = "interleaved" if chunks > 1 else "1f1b"
    plan = autosplit.compile(model, mesh=(pp, 1, 1), example_input=x, schedule=schedule,
                             chunks_per_rank=chunks)
    assert plan.n_stages == pp * chunks
    out = run_chain(plan, x)
    expected = reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    expected.square().mean().backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    for k, p in reference.named_parameters():
        assert grads[k] is not None, f"no gradient reached {k}"
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-5, atol=1e-5, msg=k)


def test_stages_hold_only_their_parameters_under_original_names():
    model = timm_cls()
    plan = autosplit.compile(model, mesh=(3, 1, 1), example_input=torch.randn(2, 3, 32, 32))
    names = [set(dict(m.named_parameters())) for m in plan.modules]
    assert set().union(*names) == set(dict(model.named_parameters()))
    assert sum(len(n) for n in names) == len(dict(model.named_parameters())), "a parameter sits in two stages"
    assert "patch_embed.proj.weight" in names[0] and "head.weight" in names[-1]


def test_stage_outputs_are_next_stage_inputs():
    plan = autosplit.compile(HandViT(), mesh=(4, 1, 1), example_input=torch.randn(2, 3, 32, 32))
    for a, b in zip(plan.stages, plan.stages[1:]):
        assert [t.name for t in a.outputs] == [t.name for t in b.inputs]
        assert all(t.shape == (2, 16, 32) for t in b.inputs)


def _vit_b(name="vit_base_patch16_224"):
    with torch.device("meta"):
        return timm.create_model(name)


@pytest.mark.parametrize("name,pp,strictly", [
    ("vit_base_patch16_224", 4, False),   # 12 blocks divide by 4 and the stem is 3% of a stage: a tie
    ("vit_base_patch16_224", 5, True),    # 12 blocks don't divide by 5
    ("vit_base_patch16_224", 8, True),
    ("vit_base_patch32_224", 4, True),    # divides, but the patch embedding is a third of a block
])
@pytest.mark.default_cases('vit_base_patch16_224-5-True')
def test_balance_never_worse_than_equal_layers(name, pp, strictly):
    plan = autosplit.compile(_vit_b(name), mesh=(pp, 1, 1), example_input=torch.empty(8, 3, 224, 224, device="meta"))
    ours, equal = plan.balance()
    assert ours <= equal + 1e-9
    if strictly:
        assert ours < 0.99 * equal, (ours, equal)


def test_meta_model_plans_without_allocating():
    plan = autosplit.compile(_vit_b(), mesh=(2, 1, 1), example_input=torch.empty(4, 3, 224, 224, device="meta"))
    assert all(p.device.type == "meta" for m in plan.modules for p in m.parameters())
    assert "blocks" in plan.summary()


def test_summary_and_dump(tmp_path):
    plan = autosplit.compile(timm_cls(), mesh=(2, 1, 1), example_input=torch.randn(2, 3, 32, 32))
    text = plan.summary()
    assert text.count("\n") >= 4 and "pp1.c0" in text and "balance" in text
    files = plan.dump(tmp_path)
    data = json.loads((tmp_path / "plan.json").read_text())
    assert len(data["stages"]) == 2 and data["stages"][0]["outputs"][0]["shape"] == [2, 17, 32]
    code = (tmp_path / "pp0_tp0" / "stage0.py").read_text()
    assert "blocks.0.attn" in code and "def forward" in code
    assert (tmp_path / "stage1.dot").read_text().startswith("digraph")
    assert "rank 0" in (tmp_path / "schedule.txt").read_text()
    assert len(files) >= 6


@pytest.mark.parametrize("flags,options", [
    ([], {}),
    (["--mesh", "2,4,1", "--tp-mode", "2d", "--tp-2d-form", "summa"], {"tp_mode": "2d", "tp_2d_form": "summa"}),
    (["--mesh", "2,2,1", "--sequence-parallel", "--memory-budget", "8GiB"], {"sequence_parallel": True,
                                                                             "memory_budget": "8GiB"}),
    (["--mesh", "2,1,2", "--schedule", "interleaved", "--chunks-per-rank", "2", "--num-microbatches", "4",
      "--autocast", "bf16", "--recompute", "block", "--dp-shard", "auto", "--memory-budget", "1GiB",
      "--leaf-modules", "Attention", "--stage-bounds", "20,51,75,101"],
     {"schedule": "interleaved", "chunks_per_rank": 2, "num_microbatches": 4, "autocast": torch.bfloat16,
      "recompute": "block", "dp_shard": True, "memory_budget": "1GiB", "leaf_modules": ["Attention"],
      "stage_bounds": [20, 51, 75, 101]}),
])
@pytest.mark.default_cases('flags3-options3')       # the most options at once
def test_cli_plan_prints_the_plans_summary(tmp_path, capsys, flags, options):
    """The CLI's table is plan.summary() of the same compile: every option reaches the compiler."""
    from autosplit.__main__ import build_model, main
    argv = ["plan", "vit_small_patch16_224", "--mesh", "2,1,1", "--batch", "4", "--out", str(tmp_path)] + flags
    assert main(argv) == 0
    out = capsys.readouterr().out
    mesh = flags[flags.index("--mesh") + 1] if "--mesh" in flags else "2,1,1"
    plan = autosplit.compile(build_model("vit_small_patch16_224"), mesh=mesh, device="h100",
                             example_input=torch.empty(4, 3, 224, 224, device="meta"), **options)
    assert plan.summary() in out
    assert (tmp_path / "plan.json").exists()


def _plan_flags() -> dict:
    """dest -> argparse action of every flag of ``autosplit plan``."""
    from autosplit.__main__ import _parser
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a for a in sub.choices["plan"]._actions}


def test_every_plan_option_has_a_cli_flag_with_help():
    flags = _plan_flags()
    missing = [name for name in PlanOptions.names() if name not in flags]
    assert not missing, f"PlanOptions fields without an `autosplit plan` flag: {missing}"
    assert all(a.help for a in flags.values()), [d for d, a in flags.items() if not a.help]
    from autosplit.cost_model.profiles import NAMES
    assert set(flags["device"].choices) == set(NAMES) >= {"h100", "h200", "a100", "rtx4090", "cpu"}
    from autosplit.__main__ import _parser
    assert _parser().prog == "autosplit"


def test_options_object_and_keywords_plan_the_same():
    model, x = timm_cls(depth=2), torch.randn(2, 3, 32, 32)
    kw = dict(schedule="gpipe", num_microbatches=3, recompute="stage", device="h200")
    by_keywords = autosplit.compile(model, mesh=(2, 1, 1), example_input=x, **kw)
    by_options = autosplit.compile(model, mesh=(2, 1, 1), example_input=x, options=PlanOptions(**kw))
    overridden = autosplit.compile(model, mesh=(2, 1, 1), example_input=x, schedule="gpipe",
                                   options=PlanOptions(**{**kw, "schedule": "1f1b"}))
    assert by_keywords.summary() == by_options.summary() == overridden.summary()


def test_unknown_option_is_named_with_the_valid_ones():
    with pytest.raises(AutosplitError, match=r"parallelize\(\) got unknown option 'memory_budgt' \(did you mean "
                                             r"'memory_budget' for 'memory_budgt'\?\); valid options: tp_mode, "):
        autosplit.parallelize(timm_cls(depth=2), mesh=(1, 1, 1), memory_budgt="8GiB")   # before any rendezvous
    with pytest.raises(AutosplitError, match=r"compile\(options=\{.*\}\): expected an autosplit.options.PlanOptions"):
        autosplit.compile(timm_cls(depth=2), example_input=torch.randn(2, 3, 32, 32), options={"schedule": "gpipe"})


# ---- bad input: each a clear error -----------------------------------------------------------------

def test_too_many_stages():
    with pytest.raises(AutosplitError, match=r"pp\(40\) \* chunks_per_rank\(1\) = 40 stages.*only \d+ places"):
        autosplit.compile(timm_cls(depth=2), mesh=(40, 1, 1), example_input=torch.randn(2, 3, 32, 32))


@pytest.mark.parametrize("mesh,match", [((0, 1, 1), "pp=0"), ((2, -1, 1), "tp=-1"), ((2, 1, 0), "dp=0"),
                                        ((2, 1), "three integers")])
def test_bad_mesh(mesh, match):
    with pytest.raises(AutosplitError, match=match):
        autosplit.compile(timm_cls(), mesh=mesh, example_input=torch.randn(2, 3, 32, 32))


def test_example_input_of_wrong_rank():
    with pytest.raises(AutosplitError, match=r"(?s)module 'patch_embed'.*shape \(3, 32, 32\).*one microbatch"):
        autosplit.compile(timm_cls(), mesh=(2, 1, 1), example_input=torch.randn(3, 32, 32))


def test_meta_model_without_example_input():
    with pytest.raises(AutosplitError, match="example_input is required: the model is on the meta device"):
        autosplit.compile(_vit_b(), mesh=(2, 1, 1))


def test_untraceable_module_names_module_and_line():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x * 2
            return x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.gate = DataDependent()

        def forward(self, x):
            return self.gate(self.lin(x))

    with pytest.raises(TraceError, match=r"module 'gate'.*DataDependent(.|\n)*test_compile.py:\d+: if x.sum\(\) > 0(.|\n)*leaf_modules"):
        autosplit.compile(Net(), mesh=(1, 1, 1), example_input=torch.randn(2, 4))
    plan = autosplit.compile(Net(), mesh=(1, 1, 1), example_input=torch.randn(2, 4), leaf_modules=[DataDependent])
    assert plan.n_stages == 1


def test_memory_budget_moves_the_cut_or_refuses_clearly():
    example = torch.empty(8, 3, 224, 224, device="meta")
    free = autosplit.compile(_vit_b(), mesh=(4, 1, 1), example_input=example)
    peak = max(s.memory_bytes for s in free.stages)
    low = min(s.memory_bytes for s in free.stages)
    budget = (peak + low) / 2 + 0.3 * (peak - low)          # below the free plan's first stage
    tight = autosplit.compile(_vit_b(), mesh=(4, 1, 1), example_input=example, memory_budget=budget)
    assert max(s.memory_bytes for s in tight.stages) <= budget < peak
    assert tight.bounds != free.bounds
    with pytest.raises(AutosplitError, match=r"no cut into 4 stages fits the memory budget of 0\.10 GiB"):
        autosplit.compile(_vit_b(), mesh=(4, 1, 1), example_input=example, memory_budget=0.1 * 2**30)


def test_every_node_carries_a_spec():
    plan = autosplit.compile(timm_cls(), mesh=(2, 1, 1), example_input=torch.randn(2, 3, 32, 32))
    assert all("tp" in n.meta["spec"] for n in plan.graph.graph.nodes)


def test_block_checkpointing_wraps_each_layer():
    from autosplit.runtime.stage.checkpointing import Checkpointed, checkpointed
    model = timm_cls(depth=4)
    plan = autosplit.compile(model, mesh=(2, 1, 1), example_input=torch.randn(2, 3, 32, 32))
    stage = plan.modules[1]
    wrapped = checkpointed(stage, model, "block")
    n_blocks = len({n.meta["module_path"].split(".")[1] for n in stage.graph.nodes
                    if n.meta.get("module_path", "").startswith("blocks.")})
    assert sum(isinstance(m, Checkpointed) for m in wrapped.children()) == n_blocks
    inputs = [torch.randn(t.shape) for t in plan.stages[1].inputs]
    torch.testing.assert_close(wrapped(*inputs)[0], stage(*inputs)[0])


@pytest.mark.parametrize("granularity", ["stage", "block"])
def test_checkpointing_lowers_measured_saved_bytes(granularity):
    """Bytes autograd actually saves in one stage's forward (counted by saved-tensor hooks), with and
    without recomputation: checkpointing keeps much less, as the plan predicts."""
    from autosplit.runtime.stage.checkpointing import checkpointed
    torch.manual_seed(0)
    model = timm_cls(depth=4)
    plan = autosplit.compile(model, mesh=(1, 1, 1), example_input=torch.randn(4, 3, 32, 32))
    stage = plan.modules[0]
    x = torch.randn(4, 3, 32, 32)

    def saved_bytes(module) -> int:
        seen, total = set(), [0]

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.dtype, tuple(t.shape))
            if key not in seen and not isinstance(t, torch.nn.Parameter):
                seen.add(key)
                total[0] += t.numel() * t.element_size()
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x)[0].sum()
        return total[0]

    free, kept = saved_bytes(stage), saved_bytes(checkpointed(stage, model, granularity))
    assert kept < 0.5 * free, (kept, free)
