"""Runtime bad-input corpus: each mistake gives one clear error, of the expected type, on the expected
ranks, naming its cause; never a hang, an abort or a wrong answer.  Cases live in checks_bad_input.py.

Table columns: case name, exception type, ranks that raise it, words the message must contain,
whether the module must still train after the error (ok_after).
"""
import pytest

from tests.checks_bad_input import run_case
from tests.dist_pool import Pool

A = "AutosplitError"
EVERY = (0, 1)

CASES = [
    # parallelize arguments
    ("mesh_product", A, EVERY, ["pp(2) * tp(1) * dp(2) != WORLD_SIZE(2)"], False),
    ("dp_leftover", A, EVERY, ["dp=-1", "WORLD_SIZE(2) is not divisible by pp(3) * tp(1) = 3"], False),
    ("mesh_axis_zero", A, EVERY, ["mesh axis pp=0 must be a positive integer"], False),
    ("mesh_not_three", A, EVERY, ["expected three integers (pp, tp, dp)"], False),
    ("timeout_zero", A, EVERY, ["timeout_s=0 must be a positive, finite number of seconds"], False),
    ("timeout_negative", A, EVERY, ["timeout_s=-5.0 must be a positive"], False),
    ("microbatches_zero", A, EVERY, ["num_microbatches=0 (int) must be a positive integer"], False),
    ("bad_schedule", A, EVERY, ["schedule='zigzag'", "expected one of"], False),
    ("loss_reduction_none", A, EVERY, ["reduction='none'", "scalar per microbatch"], False),
    ("tuple_output", A, EVERY, ["forward returns a tuple of 2 values", "single output tensor"], False),
    ("dict_output", A, EVERY, ["forward returns a dict with keys ['logits']"], False),
    # step / predict arguments, wrong on every rank or on one rank only
    ("labels_rows_everywhere", A, EVERY, ["step: labels have 2 rows but the batch has 4"], True),
    ("labels_rows_one_rank", A, EVERY, ["rank 1 (pp=1, tp=0, dp=0) found: step: labels have 2 rows but the "
                                        "batch has 4", "so no rank ran step (call 1)"], True),
    ("images_not_tensor", A, EVERY, ["step: input 0 is str; expected a tensor"], True),
    ("indivisible_one_rank", A, EVERY, ["rank 1 called step (call 1) with images (5, 3, 32, 32)",
                                        "batch of 5 rows is not divisible by num_microbatches(2)"], True),
    ("shape_one_rank_after_first_step", A, EVERY, ["rank 1 called step (call 2) with images (8, 3, 32, 32)",
                                                   "rank 0 called step (call 2) with images (4, 3, 32, 32)",
                                                   "plan was built for [((2, 3, 32, 32), 'float32')]"], True),
    ("lazy_plans_differ_in_batch", A, EVERY, ["rank 1 called step (call 1) with images (8, 3, 32, 32) float32, "
                                              "labels (8,) int64 while rank 0 called step (call 1) with "
                                              "images (4, 3, 32, 32)"], False),
    ("predict_bad_dtype_one_rank", A, EVERY, ["rank 1 (pp=1, tp=0, dp=0) found: predict inputs give",
                                              "'float64'"], True),
    # communicating calls made by some ranks only
    ("clip_on_one_rank", A, EVERY, ["rank 1 called clip_grad_norm_ (call 2) while rank 0 called step (call 2)"], True),
    ("predict_while_step", A, EVERY, ["rank 1 called step (call 1) while rank 0 called predict (call 1)"], True),
    ("full_state_dict_on_one_rank", A, EVERY, ["rank 1 called step (call 1) while rank 0 called "
                                               "full_state_dict (call 1)"], True),
    ("clip_max_norm_differs", A, EVERY, ["rank 1 called clip_grad_norm_ (call 2) with max_norm=2.0 while rank 0 "
                                         "called clip_grad_norm_ (call 2) with max_norm=1.0"], True),
    ("clip_bad_max_norm", A, EVERY, ["clip_grad_norm_: max_norm=-1.0 must be a positive finite number"], True),
    # ranks that planned different jobs, or hold different models
    ("microbatches_differ", A, EVERY, ["ranks planned different jobs", "rank 1 planned num_microbatches=4, rank 0 "
                                       "planned 2", "rank 1 planned microbatch=(1, 3, 32, 32) float32, rank 0 "
                                       "planned (2, 3, 32, 32) float32"], False),
    ("schedule_differs", A, EVERY, ["rank 1 planned schedule=gpipe (chunks_per_rank=1), rank 0 planned 1f1b"], False),
    ("seeds_differ_dp", A, EVERY, ["parameters differ between ranks: rank 1 holds different values than rank 0 "
                                   "for 'cls_token', 'pos_embed', 'patch_embed.proj.weight'", "manual_seed"], False),
    ("seeds_differ_pp", A, EVERY, ["parameters differ between ranks: rank 1 holds different values than rank 0 "
                                   "for 'cls_token'"], False),
    ("load_missing_keys_one_rank", A, EVERY, ["rank 1 (pp=1, tp=0, dp=0) found: load_full_state_dict: missing "
                                              "keys ['blocks.0.attn.proj.bias'"], True),
    ("load_different_values", A, EVERY, ["parameters differ between ranks: rank 1 holds different values"], False),
    ("plan_fails_on_one_rank", A, EVERY, ["a rank could not plan the job, so no rank runs it: rank 1 (pp=1, tp=0, "
                                          "dp=0): ", "memory"], False),
    ("load_not_a_dict", A, EVERY, ["load_full_state_dict: expected a dict of tensors", "got list"], True),
]


def _check(name, kind, ranks, words, ok_after, results):
    for rank, r in enumerate(results):
        if rank not in ranks:
            assert r["error"] is None, (name, rank, r)
            continue
        assert r["error"] is not None, (name, rank, "no error raised")
        expected = kind[rank] if isinstance(kind, dict) else kind
        assert r["error"].startswith(expected + ":"), (name, rank, r["error"])
        for w in words:
            assert w in r["error"], (name, rank, w, r["error"])
        if ok_after:
            assert r["ok_after"] > 0, (name, rank, r)


@pytest.mark.parametrize("name,kind,ranks,words,ok_after", CASES, ids=[c[0] for c in CASES])
# one mistake of each kind: an argument, the model's output, a step's input on one rank, a communicating
# call on some ranks, different jobs, different models, a load, a plan (and test_runtime's bad inputs)
@pytest.mark.default_cases("mesh_product", "tuple_output", "labels_rows_one_rank", "predict_while_step",
                           "microbatches_differ", "seeds_differ_pp", "load_missing_keys_one_rank",
                           "plan_fails_on_one_rank")
def test_bad_input_is_one_clear_error(pool2, name, kind, ranks, words, ok_after):
    _check(name, kind, ranks, words, ok_after, pool2.run(run_case, name, timeout=90))


def test_corpus_is_large_enough():
    assert len(CASES) >= 15


# Cases that leave the ranks unusable (a failure published to the store): one fresh pool for them.
FRESH = [
    # the rank whose loss failed keeps the error's own type; the other learns it as a RankFailure
    ("loss_not_scalar", {0: "RankFailure", 1: "AutosplitError"}, EVERY,
     ["loss_fn returned a tensor of shape (2,) for logits of shape (2, 10)", "must return a scalar"], False),
]


@pytest.mark.slow       # a fresh pool; a rank's own error reaching the other: test_runtime's failure test
def test_bad_input_found_while_running_stops_every_rank():
    pool = Pool(2)
    try:
        for case in FRESH:
            _check(*case, pool.run(run_case, case[0], timeout=90))
    finally:
        pool.close(force=True)
