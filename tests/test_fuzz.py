"""The differential fuzzer (`fuzz.py`): generated uses are exact against
plain Keras's large batch, or warned.

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
