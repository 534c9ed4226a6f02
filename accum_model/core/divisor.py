"""What Keras divides a micro-batch's loss by.

A window is exact when each micro-batch's gradient is weighted by that
divisor. Each Keras adapter reads it where its Keras reduces a loss (its
`recording_loss_reductions`), where every mask is known: the Keras mask on
the prediction, the mask a loss makes itself (such as `ignore_class`), and
the sample weights. This module holds the arithmetic all of them share;
the tensors it reads come through a `ShapeOps` of the backend in use.
"""

import collections

from accum_model.core import class_tree
from accum_model.core.messages import warn_once

ShapeOps = collections.namedtuple("ShapeOps", [
    # `(value) -> tensor`.
    "convert",
    # `(tensor) -> float32`: its number of elements.
    "count",
    # `(mask) -> float32`: its number of true elements.
    "count_true",
    # `(tensor) -> int32`: its first dimension.
    "first_dimension",
    # `(tensor) -> float32`: the product of its dimensions but the last.
    "leading_elements",
    # `(structure) -> list`: its leaves, as Keras flattens it.
    "flatten",
    # `(tensor) -> float32`.
    "to_float32",
])

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


def reduction_of(values, reduction, ops, mask=None, weight_sum=None):
    """The `Reduction` Keras applies to per-element loss `values`.

    Args:
        values: The per-element losses before reduction.
        reduction: Str. The loss's reduction, as the Keras in use names it
            ("sum_over_batch_size", "mean", "mean_with_sample_weight",
            "sum"; None or "none" for an unreduced loss).
        ops: The backend's `ShapeOps`.
        mask: Bool tensor of the valid elements, or None.
        weight_sum: Float32 scalar tensor, or None. What a mean weighted by
            the sample weights (Keras 3's "mean_with_sample_weight") divides
            by, when it does.
    """
    values = ops.convert(values)
    if reduction in (None, "none") or len(values.shape) == 0:
        return Reduction(reduction, None, may_vary=True)
    if reduction == SUM:
        return Reduction(SUM, None, may_vary=False)
    if weight_sum is not None:
        return Reduction(reduction, weight_sum, may_vary=True)
    if mask is not None:
        return Reduction(reduction, ops.count_true(mask), may_vary=True)
    unknown_length = any(d is None for d in values.shape[1:])
    return Reduction(reduction, ops.count(values), may_vary=unknown_length)


def batch_size(x, ops):
    """The number of samples in a batch of inputs `x`, as an int32 tensor."""
    first_input = next(i for i in ops.flatten(x) if i is not None)
    return ops.first_dimension(first_input)


def is_summed(reductions):
    """Whether every loss term was reduced with "sum" (none divides)."""
    return bool(reductions) and all(r.reduction == SUM for r in reductions)


def micro_batch_weight(reductions, fallback, model_name, has_other_losses):
    """The micro-batch weight from the reductions of its loss terms.

    One term, or several whose divisors keep one ratio: the first term's
    divisor, exact. Several that may not: the first term's, with a one-time
    warning naming `micro_batch_weight`. Returns `SUM` for losses reduced
    by "sum".

    Args:
        reductions: List of `Reduction`, one per loss term.
        fallback: Callable returning the divisor read from the prediction
            (see `fallback_divisor`), for when no term says it.
        model_name: Str. Names the model in warnings.
        has_other_losses: Bool. Whether the model adds losses of its own
            (regularization, `add_loss`).
    """
    if not reductions:
        return fallback()
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
        first = Reduction(first.reduction, fallback(), first.may_vary)
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


def default_weight(model, x, y_pred, get_mask, ops):
    """What Keras divided the compiled loss by in this micro step (see
    `AccumulatingModel.micro_batch_weight`), as a float32 scalar.

    Args:
        model: The accumulating model, in its training step (which recorded
            its loss terms' reductions in `_traced_loss_reductions`).
        x: The micro-batch's inputs.
        y_pred: The predictions.
        get_mask: Callable returning a tensor's Keras mask, or None.
        ops: The backend's `ShapeOps`.
    """
    if model._accumulation.weight_from_batch_size:
        return ops.to_float32(batch_size(x, ops))
    weight = micro_batch_weight(
        getattr(model, "_traced_loss_reductions", []),
        lambda: fallback_divisor(x, y_pred, get_mask, ops),
        type(model).__name__, has_other_losses=bool(model.losses),
    )
    # "sum": nothing divides; the window is the sum of its micro-batches.
    return ops.to_float32(1.0) if weight is SUM else weight


def fallback_divisor(x, y_pred, get_mask, ops):
    """Keras's divisor read from the first output, when no loss was seen.

    Losses reduce the last axis of the prediction, so an element is one
    position of `y_pred.shape[:-1]`, or a valid one under a Keras mask.

    Args:
        x: The micro-batch's inputs.
        y_pred: The predictions (nested structure).
        get_mask: Callable returning a tensor's Keras mask, or None.
        ops: The backend's `ShapeOps`.
    """
    outputs = [o for o in ops.flatten(y_pred) if o is not None]
    if not outputs:
        return ops.to_float32(batch_size(x, ops))
    output = outputs[0]
    mask = get_mask(output)
    if mask is not None:
        return ops.count_true(mask)
    if len(output.shape) <= 1:
        return ops.count(output)
    return ops.leading_elements(output)


def _warn_once(model_name, message):
    warn_once(model_name, f"{model_name}: {message}")


def warn_if_activity_penalty_is_masked(model, y_pred, get_mask, ops):
    """Warns (once) where one micro-batch weight cannot fit every loss term.

    With a Keras mask on the output, a micro-batch is weighted by its valid
    elements, right for the masked loss; an activity regularizer adds a
    per-sample penalty, which the large batch weights by samples.

    Args:
        model: The accumulating model, in its training step.
        y_pred: The predictions.
        get_mask: Callable returning a tensor's Keras mask, or None.
        ops: The backend's `ShapeOps`.
    """
    model_class = type(model)
    base = class_tree.accumulating_base(model_class)
    if model_class.micro_batch_weight is not base.micro_batch_weight:
        return
    masked = any(get_mask(output) is not None
                 for output in ops.flatten(y_pred) if output is not None)
    regularized = [
        layer.name for layer in model._flatten_layers()
        if getattr(layer, "activity_regularizer", None) is not None
    ]
    if masked and regularized:
        warn_once(
            model_class,
            "The output carries a Keras mask, so each micro-batch is "
            "weighted by its valid elements, but layers "
            f"{regularized} add an activity penalty per sample: the window "
            "then weights that penalty unlike the large batch does. Override "
            "`micro_batch_weight` (e.g. to return the batch size), or drop "
            "the activity regularizer, to make the trade-off explicit.",
        )
