"""What every backend's micro step decides alike, in one place.

The TensorFlow step, the JAX step and the PyTorch step each compute a
micro-batch's loss and gradients their own way; what follows from how
Keras reduced the loss (`loss_reduced`) and what the step adds to its logs
(`logged`), they take from here. Pure Python over what the step hands in;
imports no Keras.
"""

from accum_model.core import class_tree
from accum_model.core import divisor
from accum_model.core import window

# The log entry that counts the windows skipped because a gradient
# overflowed.
SKIPPED_WINDOWS = "skipped_windows"


def loss_reduced(model, reductions, y_pred, get_mask, shape_ops):
    """What a micro step settles once Keras has reduced its loss: the
    model keeps the reductions for `micro_batch_weight`, a loss term that
    one weight cannot serve is warned of, and the window's divisor is
    decided. Returns whether the window divides by its weight
    (`divides_by_weight`).

    Args:
        model: The accumulating model, in its training step.
        reductions: One `divisor.Reduction` per loss term, as recorded.
        y_pred: The predictions.
        get_mask: Callable returning a tensor's Keras mask, or None.
        shape_ops: The backend's `divisor.ShapeOps`.
    """
    model._traced_loss_reductions = reductions
    divisor.warn_where_one_weight_cannot_serve(model, y_pred, get_mask,
                                               shape_ops)
    return divides_by_weight(type(model),
                             model._accumulation.weight_from_batch_size,
                             reductions)


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


def shows_skipped_windows(loss_scaled, settings):
    """Whether the logs count skipped windows: wherever the window's end
    checks anything (`window.end_checks`), so that a skip never passes
    silently."""
    return bool(window.end_checks(loss_scaled, settings))


def logged(logs, skipped_windows, loss_scaled, settings):
    """The step's `logs`, with the count of skipped windows where a window
    can be skipped (`shows_skipped_windows`; `settings` is the model's
    `Settings`). `skipped_windows` is a callable returning the count, read
    only there."""
    if not shows_skipped_windows(loss_scaled, settings):
        return logs
    return {**logs, SKIPPED_WINDOWS: skipped_windows()}


# A batch split inside the step (`micro_batch_size`) -------------------------
#
# The step runs the batch's micro-batches one after another into the window.
# The first counts as the step's micro step, so that windows, epochs and
# schedules count the batches `fit()` hands out; the others add their
# gradients, weights and samples without counting; the window may end only
# after the last.


def micro_batch_count(batch_size, micro_batch_size, ops=None):
    """How many micro-batches of at most `micro_batch_size` samples a batch
    of `batch_size` splits into: at least 1 (an empty batch is one empty
    micro-batch). `batch_size` is an int, or an int scalar of the backend
    whose `ArrayOps` is `ops`."""
    count = (batch_size + micro_batch_size - 1) // micro_batch_size
    if ops is None:
        return max(count, 1)
    return ops.maximum(count, 1)


def micro_batch_bounds(batch_size, micro_batch_size):
    """The `(start, stop)` rows of each micro-batch of a batch of the int
    `batch_size` (`micro_batch_count` of them; the last may be short)."""
    return [(start, min(start + micro_batch_size, batch_size))
            for start in range(0, max(batch_size, 1), micro_batch_size)]


def micro_batch_candidates(batch_size):
    """The sizes `micro_batch_size="auto"` tries for a batch of the int
    `batch_size`, smallest first: the powers of two below it, and itself."""
    sizes = []
    size = 1
    while size < batch_size:
        sizes.append(size)
        size *= 2
    return sizes + [max(batch_size, 1)]


def largest_fitting(batch_size, fits):
    """The largest of `micro_batch_candidates(batch_size)` for which
    `fits(size)` holds, by bisection (a step that fits holds less than one
    that does not: more fit where fewer samples are held); None where not
    even one sample fits."""
    candidates = micro_batch_candidates(batch_size)
    low, high = 0, len(candidates) - 1
    found = None
    while low <= high:
        middle = (low + high) // 2
        if fits(candidates[middle]):
            found = candidates[middle]
            low = middle + 1
        else:
            high = middle - 1
    return found
