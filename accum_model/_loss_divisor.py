"""What Keras divides a micro-batch's loss by.

A window is exact when each micro-batch's gradient is weighted by that
divisor. It is read where Keras reduces each loss (see
`private.recording_loss_reductions`), where every mask is known: the
Keras mask on the prediction, the mask a loss makes itself (such as
`ignore_class`), and the sample weights.
"""

import tensorflow as tf

from accum_model import _checks
from accum_model._adapter import private

# A loss reduced with "sum" is divided by nothing: its window is the sum.
SUM = "sum"


class Reduction:
    """One loss term as Keras reduced it in a micro step.

    Args:
        reduction: Str. The loss's reduction.
        divisor: Float32 scalar tensor Keras divided the summed loss by, or
            None for "sum" (and for a loss that was a scalar before
            reduction, which Keras returns as it is).
        may_vary: Bool. Whether the divisor can change between micro-batches
            other than in proportion to the batch size (a mask, sample
            weights in the divisor, or a dimension of unknown length).
    """

    def __init__(self, reduction, divisor, may_vary):
        self.reduction = reduction
        self.divisor = divisor
        self.may_vary = may_vary


def reduction_of(values, sample_weight, mask, reduction):
    """The `Reduction` Keras applies to per-element loss `values`."""
    values = tf.convert_to_tensor(values)
    unknown_length = any(d is None for d in values.shape[1:])
    if reduction in (None, "none") or values.shape.rank == 0:
        return Reduction(reduction, None, may_vary=True)
    if reduction == SUM:
        return Reduction(SUM, None, may_vary=False)
    if reduction == "mean_with_sample_weight" and (
        sample_weight is not None or mask is not None
    ):
        weights = private.merged_sample_weight(
            values, sample_weight, mask, reduction
        )
        return Reduction(reduction, tf.reduce_sum(weights), may_vary=True)
    if mask is not None:
        valid = tf.reduce_sum(tf.cast(mask, tf.float32))
        return Reduction(reduction, valid, may_vary=True)
    count = tf.cast(tf.size(values), tf.float32)
    return Reduction(reduction, count, may_vary=unknown_length)


def batch_size(x):
    """The number of samples in a batch of inputs `x`, as an int32 tensor."""
    first_input = next(i for i in tf.nest.flatten(x) if i is not None)
    return tf.shape(first_input)[0]


def micro_batch_weight(reductions, x, y_pred, model_name, has_other_losses):
    """The micro-batch weight from the reductions of its loss terms.

    One term, or several whose divisors keep one ratio: the first term's
    divisor, exact. Several that may not: the first term's, with a one-time
    warning naming `micro_batch_weight`. Returns `SUM` for losses reduced
    by "sum".
    """
    if not reductions:
        return fallback_divisor(x, y_pred)
    first = reductions[0]
    kinds = {r.reduction == SUM for r in reductions}
    if kinds == {True}:
        if has_other_losses:
            _warn_once(
                model_name,
                "The loss is reduced with 'sum', and the model adds other "
                "losses (regularization) that Keras adds once per batch: a "
                "window of n micro-batches would add them n times. Use a mean "
                "reduction, or override `micro_batch_weight`.",
            )
        return SUM
    if len(kinds) > 1:
        _warn_once(
            model_name,
            "The loss terms of this model are reduced differently (one with "
            "'sum', another with a mean), so no one micro-batch weight makes "
            "the window equal the large batch. Weighting by the first mean "
            "term's divisor; override `micro_batch_weight` to choose.",
        )
        first = next(r for r in reductions if r.reduction != SUM)
    if first.divisor is None:
        # A loss that was a scalar before reduction (an output of shape
        # `(batch,)`, say): its mean ran over the prediction's elements.
        first = Reduction(first.reduction, fallback_divisor(x, y_pred),
                          first.may_vary)
    if len(reductions) > 1 and any(r.may_vary for r in reductions):
        _warn_once(
            model_name,
            "The outputs' losses divide by numbers that may change "
            "differently from one micro-batch to the next (masks, "
            "`ignore_class`, sample-weighted means, or lengths that vary), "
            "and one micro-batch weight (the first output's divisor) cannot "
            "make every output exact. Override `micro_batch_weight` to "
            "choose the weight.",
        )
    return first.divisor


def fallback_divisor(x, y_pred):
    """Keras's divisor read from the first output, when no loss was seen.

    Losses reduce the last axis of the prediction, so an element is one
    position of `y_pred.shape[:-1]`, or a valid one under a Keras mask.
    """
    outputs = [o for o in tf.nest.flatten(y_pred) if o is not None]
    if not outputs:
        return tf.cast(batch_size(x), tf.float32)
    output = outputs[0]
    mask = private.get_keras_mask(output)
    if mask is not None:
        return tf.reduce_sum(tf.cast(mask, tf.float32))
    shape = tf.shape(output)
    if output.shape.rank is not None and output.shape.rank <= 1:
        return tf.cast(shape[0], tf.float32)
    return tf.cast(tf.reduce_prod(shape[:-1]), tf.float32)


def _warn_once(model_name, message):
    _checks.warn_once(model_name, f"{model_name}: {message}")
