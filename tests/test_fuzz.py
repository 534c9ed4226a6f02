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


# Exact under mixed_float16 by the fuzzer's measure, where an optimizer
# that normalizes its steps turns 16-bit rounding into steps: the check
# called them differences at 97 and 40 times its 16-bit floor before it
# measured how far the large batch lands from its float32 twin (keras
# 3.15.1 on PyTorch).
NORMALIZED_16_BIT_USES = [
    fuzz.Use(architecture="embedding", loss="sparse_logits",
             optimizer="rmsprop", clipping="clipvalue",
             sample_weights="positive", n_gradients=2, micro_batch=2,
             samples=19, seed=11593, precision="mixed_float16"),
    fuzz.Use(architecture="kernel_regularized", loss="log_cosh",
             optimizer="adam", clipping="global_clipnorm",
             sample_weights="positive", n_gradients=2, micro_batch=3,
             samples=29, seed=11159, precision="mixed_float16",
             schedule=True, ema=True),
]


@pytest.mark.parametrize("use", NORMALIZED_16_BIT_USES,
                         ids=["embedding_rmsprop", "regularized_adam"])
def test_the_check_holds_16_bit_training_to_its_float32_twin(use):
    if "embedding" in use.architecture and fuzz.adapter.SPARSE_ROW_STRAYS:
        pytest.skip("plain Keras applies an Embedding's repeated sparse "
                    "rows in turn here, apart from the large batch")
    comparison, outcome = fuzz.check(use)
    assert outcome.exact
    assert comparison.matches, str(comparison)
