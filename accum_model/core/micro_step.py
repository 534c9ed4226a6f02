"""What every backend's micro step decides alike, in one place.

The TensorFlow step, the JAX step and the PyTorch step each compute a
micro-batch's loss and gradients their own way; whether the window divides
its sums by its weight, and what the step adds to its logs, they take from
here. Pure Python over what the step hands in; imports no Keras.
"""

from accum_model.core import class_tree
from accum_model.core import divisor
from accum_model.core import window

# The log entry that counts the windows skipped because a gradient
# overflowed.
SKIPPED_WINDOWS = "skipped_windows"


def divides_by_weight(model_class, weight_from_batch_size, reductions):
    """Whether the window divides its sums by its total weight.

    Losses reduced with "sum" divide by nothing, nor does their window: each
    micro-batch's loss is then the large batch's share as it is. Decided for
    the default `micro_batch_weight`; a weight of one's own always divides,
    as does weighting by samples (an overridden `compute_loss`).

    Args:
        model_class: The accumulating model's class.
        weight_from_batch_size: Whether micro-batches are weighted by their
            samples.
        reductions: The step's `divisor.Reduction`s, one per loss term.
    """
    return not (class_tree.has_default_micro_batch_weight(model_class)
                and not weight_from_batch_size
                and divisor.is_summed(reductions))


def shows_skipped_windows(loss_scaled, accumulators_may_overflow):
    """Whether the logs count skipped windows: wherever the window's end
    checks anything (`window.end_checks`), so that a skip never passes
    silently."""
    return bool(window.end_checks(loss_scaled, accumulators_may_overflow))


def with_skipped_windows(logs, skipped_windows):
    """The step's `logs` with the count of skipped windows added."""
    return {**logs, SKIPPED_WINDOWS: skipped_windows}
