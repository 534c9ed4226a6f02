"""What Keras divides a micro-batch's loss by.

A window is exact when each micro-batch's gradient is weighted by that
divisor. Each Keras adapter reads it where its Keras reduces a loss (its
`recording_loss_reductions`), where every mask is known: the Keras mask on
the prediction, the mask a loss makes itself (such as `ignore_class`), and
the sample weights. This module holds the arithmetic all of them share;
the tensors it reads come through a `ShapeOps` of the backend in use.
"""

import collections
import inspect

from accum_model.core import class_tree

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

# How a loss term hangs on its batch where it is not Keras's reduction of
# per-element values (see `batch_dependence`):
# one number a loss of the user's computed over the whole batch, a sum or
# a mean of unknown divisor;
SCALAR = "scalar"
# one number of a Keras loss over the whole batch (`Dice`, `Tversky` with
# `axis=None`), which no window of micro-batches reproduces;
WHOLE_BATCH = "whole_batch"
# per-sample values that use the batch's other samples (`Circle` without
# reference embeddings).
IN_BATCH = "in_batch"


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
        dependence: None, `SCALAR`, `WHOLE_BATCH` or `IN_BATCH`: how the
            loss hangs on its batch beyond the reduction.
        loss_name: Str. The loss, as messages name it.
        counts_valid: Bool. Whether the divisor counts only some elements
            (a mask, `ignore_class`, or the sum of the sample weights), so
            that it is not in proportion to the samples.
        elements_per_sample: Int, None where a dimension's length is not
            known as the step is traced, or -1 where the divisor is not
            the count of every element.
        samples: Int32 scalar tensor or None. For a loss that was one
            number before reduction, the rows of the prediction it was
            given, by which replicas' such numbers are averaged.
        function: The loss's function (a function Keras wrapped, or the
            `Loss` itself), or None where it is not known.
        weighted: Bool. Whether sample weights or a mask weighed the
            values.
    """

    def __init__(self, reduction, divisor, may_vary, dependence=None,
                 loss_name="the loss", counts_valid=False,
                 elements_per_sample=-1, samples=None, function=None,
                 weighted=False):
        self.reduction = reduction
        self.divisor = divisor
        self.may_vary = may_vary
        self.dependence = dependence
        self.loss_name = loss_name
        self.counts_valid = counts_valid
        self.elements_per_sample = elements_per_sample
        self.samples = samples
        self.function = function
        self.weighted = weighted


def reduction_of(values, reduction, ops, mask=None, weight_sum=None,
                 loss=None, prediction=None, weighted=False):
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
        loss: The `Loss` object whose values these are, or None.
        prediction: The prediction the loss was given, or None.
        weighted: Bool. Whether sample weights (or a mask) weighed the
            values.
    """
    values = ops.convert(values)
    scalar = len(values.shape) == 0
    shape = getattr(prediction, "shape", None)
    described = {"dependence": batch_dependence(
                     loss, scalar, None if shape is None else len(shape)),
                 "loss_name": _loss_name(loss),
                 "function": loss_function(loss),
                 "weighted": weighted or mask is not None}
    if scalar and shape is not None and len(shape) > 0:
        return Reduction(reduction, None, may_vary=True,
                         samples=ops.first_dimension(prediction), **described)
    if reduction in (None, "none") or scalar:
        return Reduction(reduction, None, may_vary=True, **described)
    if reduction == SUM:
        return Reduction(SUM, None, may_vary=False, **described)
    if weight_sum is not None:
        return Reduction(reduction, weight_sum, may_vary=True,
                         counts_valid=True, **described)
    if mask is not None:
        return Reduction(reduction, ops.count_true(mask), may_vary=True,
                         counts_valid=True, **described)
    lengths = tuple(values.shape[1:])
    unknown_length = any(d is None for d in lengths)
    elements = None
    if not unknown_length:
        elements = 1
        for length in lengths:
            elements *= int(length)
    return Reduction(reduction, ops.count(values), may_vary=unknown_length,
                     elements_per_sample=elements, **described)


def batch_dependence(loss, scalar, prediction_rank=None):
    """How a loss's values hang on their batch beyond Keras's reduction.

    Keras's own losses are told apart by what they take and give, not their
    names: a function with an `axis` that is None reduces the whole batch
    to one number, as does one that gives one number for a prediction of
    rank 2 or more (Tversky before it took an `axis`, keras 3.6); one with
    `ref_embeddings` that is None compares each sample with the batch's
    others. Keras's other losses give one value per element, a scalar only
    for a prediction of shape `(batch,)`, whose mean Keras then takes over
    the batch.

    Args:
        loss: The `Loss` object (a `LossFunctionWrapper` holds its function
            in `fn` and its arguments in `_fn_kwargs`, in Keras 2 and 3), or
            None where it is not known.
        scalar: Bool. Whether the values were one number.
        prediction_rank: Int, or None where it is not known.

    Returns:
        None, `SCALAR`, `WHOLE_BATCH` or `IN_BATCH`.
    """
    if loss is None:
        return None
    function = getattr(loss, "fn", None)
    if not is_keras_own(function if callable(function) else type(loss)):
        return SCALAR if scalar else None
    if function is None:
        return None
    arguments = getattr(loss, "_fn_kwargs", None) or {}
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None

    def is_none(name):
        return name in parameters and arguments.get(
            name, parameters[name].default) is None

    if is_none("axis") or (scalar and (prediction_rank or 0) >= 2):
        return WHOLE_BATCH
    if is_none("ref_embeddings"):
        return IN_BATCH
    return None


def loss_function(loss):
    """The function a compiled loss computes: the one Keras wrapped (in a
    `LossFunctionWrapper`'s `fn`), or the loss itself."""
    function = getattr(loss, "fn", None)
    return function if callable(function) else loss


def is_keras_own(thing):
    """Whether a class or function is defined by Keras (2 or 3)."""
    module = getattr(thing, "__module__", None) or ""
    return module.split(".")[0] in ("keras", "tf_keras")


def _loss_name(loss):
    """The loss as a message names it: its class, or the function that
    Keras wrapped (a function of the user's, or `keras.losses.dice`)."""
    if loss is None:
        return "the loss"
    function = getattr(loss, "fn", None)
    wrapped_only = type(loss).__name__ == "LossFunctionWrapper"
    if callable(function) and (wrapped_only or not is_keras_own(function)):
        return f"`{getattr(function, '__name__', type(loss).__name__)}`"
    return f"`{type(loss).__name__}`"


def batch_size(x, ops):
    """The number of samples in a batch of inputs `x`, as an int32 tensor."""
    first_input = next(i for i in ops.flatten(x) if i is not None)
    return ops.first_dimension(first_input)


def is_summed(reductions):
    """Whether every loss term was reduced with "sum" (none divides)."""
    return bool(reductions) and all(r.reduction == SUM for r in reductions)


def micro_batch_weight(reductions, fallback, warn, has_other_losses,
                       mean_losses=()):
    """The micro-batch weight from the reductions of its loss terms.

    One term, or several whose divisors keep one ratio: the first term's
    divisor, exact. Several that may not: the first term's, with a one-time
    warning naming `micro_batch_weight`. Returns `SUM` for losses reduced
    by "sum".

    Args:
        reductions: List of `Reduction`, one per loss term.
        fallback: Callable returning the divisor read from the prediction
            (see `fallback_divisor`), for when no term says it.
        warn: Callable taking a message: warns once for the model (its
            `_accumulation.warn_once`, so that every model is told).
        has_other_losses: Bool. Whether the model adds losses of its own
            (regularization, `add_loss`).
        mean_losses: Loss functions of the user's found to return the mean
            over the samples of their batch, as one number: weighed by the
            prediction's elements, exact where nothing weighs their values.
    """
    if not reductions:
        return fallback()
    _warn_about_batch_dependence(reductions, warn, mean_losses)
    first = reductions[0]
    kinds = {r.reduction == SUM for r in reductions}
    if kinds == {True}:
        if has_other_losses:
            warn(
                "The loss is reduced with 'sum', and the model adds other "
                "losses (regularization) that Keras adds once per batch: a "
                "window of n micro-batches would add them n times. Use a mean "
                "reduction, or override `micro_batch_weight`.",
            )
        return SUM
    if len(kinds) > 1:
        warn(
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
        warn(
            "The outputs' losses divide by numbers that may change "
            "differently from one micro-batch to the next (masks, "
            "`ignore_class`, sample-weighted means, or lengths that vary), "
            "and one micro-batch weight (the first output's divisor) cannot "
            "make every output exact. Override `micro_batch_weight` to "
            "choose the weight.",
        )
    return first.divisor


def _warn_about_batch_dependence(reductions, warn, mean_losses=()):
    """Warns (once) about each loss term no window of micro-batches can
    weigh as the large batch does, naming the way out (a loss of
    `mean_losses` is exact where nothing weighs its values)."""
    for term in reductions:
        name = term.loss_name
        exact_mean = not term.weighted and any(
            term.function is function for function in mean_losses)
        if (term.dependence == SCALAR and term.reduction != SUM
                and not exact_mean):
            warn(
                f"The loss {name} returns one number for the whole "
                "micro-batch, not one per sample, so the window cannot tell "
                "what it divides by: it weighs each micro-batch by its "
                "number of prediction elements, which is exact for a mean "
                "over them. A loss that sums over the batch trains n times "
                "too weakly: give it reduction='sum' (a keras.losses.Loss "
                "subclass) or return one value per sample. A mean over "
                "something else, such as a masked mean sum(mask * loss) / "
                "sum(mask): override `micro_batch_weight` to return that "
                "divisor (sum(mask)). A loss that compares samples within "
                "the batch (contrastive, in-batch negatives, a pairwise "
                "sigmoid loss) is taken over the micro-batch's samples, not "
                "the large batch's: no weight reproduces it.",
            )
        elif term.dependence == WHOLE_BATCH:
            warn(
                f"The loss {name} computes one value over the whole batch, "
                "which no window of micro-batches can reproduce: each "
                "micro-batch's value is its own, and the window averages "
                "them. Where the loss takes an `axis`, give it one that "
                "keeps samples apart (axis=(1, 2, 3) for images: a "
                "per-sample loss, exact); or accept the difference and "
                "override `micro_batch_weight` to choose the weights.",
            )
        elif term.dependence == IN_BATCH:
            warn(
                f"The loss {name} compares each sample with the other "
                "samples of its batch: under accumulation those are the "
                "micro-batch's, not the large batch's, so the window is "
                "not the large batch. Give it reference embeddings "
                "(ref_labels, ref_embeddings), or accept the difference.",
            )


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
    masked = _has_keras_mask(y_pred, get_mask, ops)
    weight = micro_batch_weight(
        getattr(model, "_traced_loss_reductions", []),
        lambda: fallback_divisor(x, y_pred, get_mask, ops),
        _warning_for(model), has_other_losses=bool(model.losses),
        # Under a Keras mask the elements weighed are the valid ones.
        mean_losses=(() if masked
                     else model._accumulation.mean_loss_functions),
    )
    # "sum": nothing divides; the window is the sum of its micro-batches.
    return ops.to_float32(1.0) if weight is SUM else weight


def _has_keras_mask(y_pred, get_mask, ops):
    """Whether some output of the predictions `y_pred` carries a Keras
    mask."""
    return any(get_mask(output) is not None
               for output in ops.flatten(y_pred) if output is not None)


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


def _warning_for(model):
    """Warns once for `model` (each model is told, whatever others were),
    its class named first."""
    name = type(model).__name__
    return lambda message: model._accumulation.warn_once(
        f"{name}: {message}")


def warn_where_one_weight_cannot_serve(model, y_pred, get_mask, ops):
    """The checks of a micro step's loss terms that need them traced: an
    activity penalty beside a loss of valid elements, a padded length that
    varies (see each)."""
    warn_if_activity_penalty_is_misweighted(model, y_pred, get_mask, ops)
    warn_if_padded_length_varies(
        model, model._accumulation.elements_per_sample_seen)


def warn_if_padded_length_varies(model, seen):
    """Warns (once) where a loss divides by every element, padding
    included, and the length its micro-batches are padded to varies.

    Each micro-batch then divides by its own padded length and the window
    weighs it so; the large batch divides by the length it is padded to
    itself, which the window cannot know. Seen as the step is traced: a
    length not known then (TensorFlow's data of varying shape) may vary; a
    known one is compared with those of earlier traces and steps (JAX
    traces anew for each shape, PyTorch runs each step).

    Args:
        model: The accumulating model, in its training step, with the
            reductions of its loss terms in `_traced_loss_reductions`.
        seen: Dict from a loss term's position to the set of elements
            per sample it met so far (updated).
    """
    model_class = type(model)
    base = class_tree.accumulating_base(model_class)
    if model_class.micro_batch_weight is not base.micro_batch_weight:
        return
    warn = model._accumulation.warn_once
    terms = getattr(model, "_traced_loss_reductions", [])
    for position, term in enumerate(terms):
        if term.elements_per_sample == -1 or term.reduction == SUM:
            continue
        lengths = seen.setdefault(position, set())
        lengths.add(term.elements_per_sample)
        if None in lengths or len(lengths) > 1:
            warn(
                f"The loss {term.loss_name} divides each micro-batch by all "
                "its elements, padding included, and the length the "
                "micro-batches are padded to "
                + ("is not fixed (a dimension of unknown length)"
                   if None in lengths else "varies")
                + ": where each batch is padded to its own longest, the "
                "window weighs each micro-batch by its own padded length, "
                "and the large batch divides by the length it would be "
                "padded to itself, which no window can know. Make the loss "
                "a mean over the real elements (reduction="
                "'mean_with_sample_weight' with the padding mask as sample "
                "weight, where this Keras has it, or a Keras mask on the "
                "output), exact under any padding; or pad every batch to "
                "one length.",
            )
            return


def warn_if_activity_penalty_is_misweighted(model, y_pred, get_mask, ops):
    """Warns (once) where one micro-batch weight cannot fit every loss term.

    Where the loss divides by valid elements (a Keras mask on the output,
    a mask the loss makes itself such as `ignore_class`, or a mean weighted
    by the sample weights), a micro-batch is weighted by them, right for
    the loss; an activity regularizer, or a layer's `add_loss` term found
    to be a mean over the samples, adds a per-sample penalty, which the
    large batch weights by samples.

    Args:
        model: The accumulating model, in its training step, with the
            reductions of its loss terms in `_traced_loss_reductions`.
        y_pred: The predictions.
        get_mask: Callable returning a tensor's Keras mask, or None.
        ops: The backend's `ShapeOps`.
    """
    model_class = type(model)
    base = class_tree.accumulating_base(model_class)
    if model_class.micro_batch_weight is not base.micro_batch_weight:
        return
    reductions = getattr(model, "_traced_loss_reductions", [])
    valid_only = (any(r.counts_valid for r in reductions)
                  or _has_keras_mask(y_pred, get_mask, ops))
    regularized = [
        layer.name for layer in model._flatten_layers()
        if getattr(layer, "activity_regularizer", None) is not None
    ] + list(model._accumulation.layers_adding_means)
    if valid_only and regularized:
        model._accumulation.warn_once(
            "The loss divides each micro-batch by its valid elements (a "
            "Keras mask, `ignore_class`, or a mean weighted by the sample "
            "weights), so each micro-batch is weighted by them, but layers "
            f"{regularized} add a penalty per sample (an activity "
            "penalty, or a mean added with `add_loss`): the window "
            "then weights that penalty unlike the large batch does, and no "
            "one weight is right for both. Override `micro_batch_weight` "
            "(e.g. to return the batch size), or drop the penalty, to "
            "make the trade-off explicit.",
        )
