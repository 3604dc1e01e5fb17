"""The fit of a profile's ``pass_overhead`` to a reference pipeline (cost_model/pipeline_fit.py): pure."""
import dataclasses

import pytest

from autosplit.cost_model import H100
from autosplit.cost_model.pipeline_fit import fit_pass_overhead, priced, with_pass_overhead

# a CPU host of 4 ranks on 2 cores, with the parts the step predictor already prices
HOST = dataclasses.replace(H100, name="cpu (test)", device_type="cpu", sharing=(1.0, 1.0, 1.5, 2.1),
                           p2p_post=3e-4, p2p_wake=5e-4, resume=(1.05, 1.02), link_latency=1e-4,
                           link_bandwidth=2e9)
FWD, BWD, NBYTES = 4e-3, 8e-3, 200_000


@pytest.mark.parametrize("ranks,overhead", [(4, 1.5e-3), (2, 0.7e-3), (3, 4e-3)])
def test_the_fit_recovers_the_overhead_a_reference_was_priced_with(ranks, overhead):
    measured = priced(HOST, ranks, 8, FWD, BWD, NBYTES, overhead)
    assert measured > priced(HOST, ranks, 8, FWD, BWD, NBYTES, 0.0)        # the overhead moves the price
    assert fit_pass_overhead(HOST, ranks, 8, (FWD, BWD, measured, NBYTES)) == pytest.approx(overhead, rel=1e-6)


def test_nothing_missing_fits_zero_and_a_residual_beyond_a_pass_is_capped():
    at_zero = priced(HOST, 4, 8, FWD, BWD, NBYTES, 0.0)
    assert fit_pass_overhead(HOST, 4, 8, (FWD, BWD, 0.9 * at_zero, NBYTES)) == 0.0
    assert fit_pass_overhead(HOST, 4, 8, (FWD, BWD, 10 * at_zero, NBYTES)) == FWD + BWD


def test_the_profile_takes_the_median_round_and_is_unchanged_without_rounds():
    rounds = [(FWD, BWD, priced(HOST, 4, 8, FWD, BWD, NBYTES, x), NBYTES) for x in (2e-3, 0.5e-3, 1e-3)]
    assert with_pass_overhead(HOST, 4, 8, rounds).pass_overhead == pytest.approx(1e-3, rel=1e-6)
    assert with_pass_overhead(HOST, 4, 8, None) is HOST and with_pass_overhead(HOST, 4, 8, []) is HOST
