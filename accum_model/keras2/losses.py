"""Keras 2's losses: what a micro-batch's loss is divided by, and its log.

`compile_utils.LossesContainer` divides each loss by the replicas
(`losses_utils.scale_loss_for_distribution`), and `losses.Loss.__call__`
divides a masked loss by its valid elements (`losses_utils.apply_valid_mask`,
then `compute_weighted_loss`). Checked on tf_keras 2.21.0 / TF 2.21.0, keras
2.15.0 / TF 2.15.1 and keras 2.13.1 / TF 2.13.1.
"""

import contextlib
import sys

import tensorflow as tf

from accum_model.core import divisor
from accum_model.core.patch import identity
from accum_model.core.patch import replaced
from accum_model.keras2.package import src
from accum_model.tensorflow.ops import TF_SHAPES

_losses_utils = src("utils.losses_utils")
_losses = src("losses")

# Reductions whose batch loss is one number a window can reproduce.
LOSS_REDUCTIONS = ("auto", "sum_over_batch_size", "sum")


def compute_loss(model, **arguments):
    return model.compute_loss(**arguments)


def get_keras_mask(tensor):
    return getattr(tensor, "_keras_mask", None)


def _logged_loss_metric(model):
    """The `Mean` behind the "loss" Keras 2 logs: the private
    `LossesContainer._total_loss_mean` of `model.compiled_loss`."""
    return getattr(getattr(model, "compiled_loss", None), "_total_loss_mean",
                   None)


def loss_logged_by_window(model):
    """While a micro-batch's loss is computed, keeps Keras 2 from logging it.

    `LossesContainer.__call__` adds each batch's loss to the logged "loss";
    the window logs its own loss instead (`track_loss`) when it ends.
    """
    metric = _logged_loss_metric(model)
    if metric is None:
        return contextlib.nullcontext()
    return replaced(metric, {"update_state": _log_nothing})


def _log_nothing(*args, **kwargs):
    del args, kwargs


def track_loss(model, loss, batch_size):
    """Adds a window's loss to the "loss" that `fit()` reports, weighted by
    its samples as Keras 2 weights a batch's."""
    metric = _logged_loss_metric(model)
    if metric is not None:
        metric.update_state(loss, sample_weight=batch_size)


def tracker_weighing_all_samples(model, all_samples):
    """Nothing to change: Keras 2 sums its metrics over the replicas, so a
    loss that is the whole batch's on every replica logs one device's."""
    del model, all_samples
    return contextlib.nullcontext()


def activity_penalty_is_a_mean():
    """True: Keras 2 divides a layer's activity penalty by the batch size
    (`Layer._handle_activity_regularization`, keras 2.13.1 and tf-keras
    2.21.0)."""
    return True


def logged_loss_totals(model):
    """The "loss" `fit()` logs now as `(total, count)` floats, the sums of
    Keras's `Mean` (the logged loss is total / count), or None without one.
    """
    metric = _logged_loss_metric(model)
    if metric is None:
        return None
    # Under a strategy both are synchronised on read: read tensors.
    return float(_value(metric.total)), float(_value(metric.count))


def losses_not_divided_by_replicas():
    """While tracing a loss, keeps Keras 2 from dividing it by the replicas.

    `LossesContainer.__call__` divides each mean loss, and the sum of the
    regularization losses, by the number of replicas through
    `losses_utils.scale_loss_for_distribution`; made the identity, every
    loss is this replica's own mean.
    """
    return replaced(_losses_utils,
                    {"scale_loss_for_distribution": identity})


@contextlib.contextmanager
def recording_loss_reductions(reduced=None):
    """Records how Keras 2 reduces each loss computed inside the context.

    `losses.Loss.__call__` merges the prediction's mask with the loss's,
    hands it to `losses_utils.apply_valid_mask` (which reweights the valid
    elements so that the mean divides by their number) and reduces with
    `losses_utils.compute_weighted_loss`. Both are wrapped; the returned
    list receives one `divisor.Reduction` per loss term. With `reduced`,
    each reduced loss is replaced by `reduced(loss, record)`.
    """
    records = []
    masks = []
    apply_valid_mask = _losses_utils.apply_valid_mask
    compute_weighted_loss = _losses_utils.compute_weighted_loss

    def noting_mask(losses, sample_weight, mask, reduction):
        masks.append(mask)
        if mask is None:
            return apply_valid_mask(losses, sample_weight, mask, reduction)
        # Keras 2 reweights the valid elements by total/valid, infinite for
        # a micro-batch with nothing valid (0 * inf: a NaN loss and NaN
        # gradients, which a weight of 0 does not cancel). Such a
        # micro-batch is reweighted as if all were valid, then given
        # weight 0: the loss and gradient of nothing, 0, as Keras 3's
        # `divide_no_nan` gives.
        has_valid = tf.reduce_any(tf.cast(mask, tf.bool))
        weights = apply_valid_mask(
            losses, sample_weight,
            tf.where(has_valid, mask, tf.ones_like(mask)), reduction)
        return weights * tf.cast(has_valid, weights.dtype)

    def recording(losses, sample_weight=None, reduction="sum_over_batch_size",
                  name=None):
        loss = compute_weighted_loss(losses, sample_weight,
                                     reduction=reduction, name=name)
        mask = masks.pop() if masks else None
        if reduction not in (None, "none", divisor.SUM):
            reduction = "sum_over_batch_size"  # What "auto" means here.
        loss_object, prediction = _calling_loss()
        records.append(divisor.reduction_of(
            losses, reduction, TF_SHAPES, mask, loss=loss_object,
            prediction=prediction, weighted=sample_weight is not None))
        return loss if reduced is None else reduced(loss, records[-1])

    with replaced(_losses_utils, {"apply_valid_mask": noting_mask,
                                  "compute_weighted_loss": recording}):
        yield records


def _calling_loss():
    """The `Loss` whose `__call__` called the wrapped reduction (its
    `self`) and its prediction, or (None, None):
    `Loss.__call__(self, y_true, y_pred, ...)` calls it (keras 2.13-2.15, tf_keras
    2.21), as do Keras 2's v1 training loops, which pass no `Loss`.
    """
    caller = sys._getframe(2).f_locals
    loss = caller.get("self")
    if not isinstance(loss, _losses.Loss):
        return None, None
    return loss, caller.get("y_pred")


def _value(variable):
    """A variable's value as a tensor (summed over replicas)."""
    return tf.convert_to_tensor(variable)
