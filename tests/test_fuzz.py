"""The differential fuzzer (`fuzz.py`): generated uses are exact against
plain Keras's large batch, or warned; `compare_with_large_batch` agrees
with the fuzzer on them.

A fixed set of uses runs in the suite; `ACCUM_FUZZ_USES=N` runs N (the long
mode, see CONTRIBUTING.md). A failing use is shrunk by Hypothesis to a
minimal one and reported with a script that runs it again.
"""

import os

import pytest

import fuzz
from backends import keras_2_too

hypothesis = pytest.importorskip("hypothesis")

pytestmark = keras_2_too

USES = int(os.environ.get("ACCUM_FUZZ_USES", "10"))


@hypothesis.settings(max_examples=USES, deadline=None, database=None,
                     derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(use=fuzz.uses())
def test_each_generated_use_is_exact_or_warned(use):
    outcome = fuzz.run(use)
    hypothesis.event("exact" if outcome.exact else "not exact")
    if outcome.warned_but_exact:
        hypothesis.event("warned but exact")
    if outcome.plain_failed:
        hypothesis.event("plain Keras failed")
    assert outcome.passes, fuzz.reproduction(use, outcome)


CHECKED_USES = int(os.environ.get("ACCUM_CHECK_FUZZ_USES", "3"))


@hypothesis.settings(max_examples=CHECKED_USES, deadline=None,
                     database=None, derandomize=True,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(use=fuzz.uses().map(fuzz.checked_use))
def test_the_large_batch_check_never_matches_where_training_differs(use):
    # `compare_with_large_batch` says "matches" only where the fuzzer found
    # the training exact. (The other way round, a "differs" near a 16-bit
    # or a cancelling gradient's floor, which the two measure apart, is a
    # false alarm the long mode prints.)
    comparison, outcome = fuzz.check(use)
    if (comparison.matches is None or outcome.refused
            or outcome.plain_failed):
        hypothesis.event("no verdict")
        return
    hypothesis.event("agree" if comparison.matches == outcome.exact
                     else "differs where exact")
    assert outcome.exact or not comparison.matches, (
        f"{comparison}\n{outcome}\n{fuzz.reproduction(use, outcome)}")
