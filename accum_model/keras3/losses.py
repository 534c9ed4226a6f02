"""Keras 3's losses: what a micro-batch's loss is divided by, and its log.

Backend-free (`keras.ops`). Checked on keras 3.6.0 / TF 2.16.2, 3.10.0 /
TF 2.18.1 and 3.15.1 / TF 2.21.0 and on keras 3.15.1 / JAX (the tests that
exercise each function pass, `.ci/matrix`).
"""

import contextlib
import functools
import inspect
import sys

import keras
import numpy as np
from keras import ops
from keras.src.backend.common import masking
from keras.src.losses import loss as keras_loss_module

from accum_model.core import divisor
from accum_model.core.patch import identity
from accum_model.core.patch import replaced

# Reductions whose batch loss is one number a window can reproduce.
LOSS_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight",
                   "sum")


@functools.cache
def activity_penalty_is_a_mean():
    """Whether this Keras divides a layer's activity penalty by the batch
    size (keras 3.14 and newer do, measured on 3.15.1; 3.6-3.13 sum it over
    the batch, measured on 3.6.0 and 3.10.0). Call it eagerly: it runs a
    layer."""
    # In float32 whatever the global policy: TensorFlow converts no
    # bfloat16 tensor to NumPy (tensorflow 2.16-2.21).
    layer = keras.layers.Activation("linear", activity_regularizer="l2",
                                    dtype="float32")
    penalties = []
    for rows in (1, 2):
        layer(np.ones((rows, 1), "float32"))
        penalties.append(float(ops.convert_to_numpy(
            ops.cast(layer.losses[0], "float32"))))
    return bool(np.isclose(penalties[0], penalties[1]))


def get_keras_mask(tensor):
    """The mask a Keras layer attached to `tensor`, or None."""
    return masking.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Attaches `mask` to `tensor` as a Keras layer does (None clears it)."""
    masking.set_keras_mask(tensor, mask)


def compute_loss(model, **arguments):
    """Calls `model.compute_loss` with `training=True` where it takes it.

    Keras's `Trainer._compute_loss` makes that choice for overrides of
    `compute_loss` written before Keras 3.3, which lack `training`.
    """
    if "training" in inspect.signature(model.compute_loss).parameters:
        return model.compute_loss(training=True, **arguments)
    return model.compute_loss(**arguments)


def track_loss(model, loss, batch_size):
    """Adds a window's loss to the "loss" that `fit()` reports.

    Keras keeps that `Mean` metric in the private `Trainer._loss_tracker`;
    its own `train_step` updates it directly with each batch's loss,
    weighted by the batch size, and no public accessor exists. A window
    counts like one large batch.
    """
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is not None:
        tracker.update_state(loss, sample_weight=batch_size)


@contextlib.contextmanager
def tracker_weighing_all_samples(model, all_samples):
    """Inside the block, Keras's loss tracker weighs each loss by
    `all_samples(samples)`, the samples of the step on all replicas, where
    its own step hands in one replica's.

    Keras 3.6 reads the first replica's tracker alone under a
    `MirroredStrategy` (its metric variables are not aggregated; measured
    on keras 3.6.0); keras 3.10.0 and 3.15.1 sum the replicas' trackers.
    A loss that is the whole batch's on every replica, weighed by the
    whole batch's samples, logs one device's either way. Keras's
    `test_step` updates the private `Trainer._loss_tracker` (checked on
    keras 3.6.0, 3.10.0 and 3.15.1).
    """
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is None:
        yield
        return
    update_state = tracker.update_state

    def weighing_all_samples(values, sample_weight=None):
        if sample_weight is not None:
            sample_weight = all_samples(sample_weight)
        return update_state(values, sample_weight=sample_weight)

    tracker.update_state = weighing_all_samples
    try:
        yield
    finally:
        del tracker.update_state


def loss_logged_by_window(model):
    """Nothing to keep from the logs: Keras 3's `compute_loss` logs nothing
    (its `train_step` does, and the window's end does here)."""
    del model
    return contextlib.nullcontext()


def logged_loss_totals(model):
    """The "loss" `fit()` logs now as `(total, count)` floats, the sums of
    Keras's `Mean` (the logged loss is total / count), or None without one.
    """
    metric = getattr(model, "_loss_tracker", None)
    if metric is None:
        return None
    # Under a strategy both are synchronised on read: read tensors.
    return float(_value(metric.total)), float(_value(metric.count))


def losses_not_divided_by_replicas():
    """While tracing a loss, keeps Keras from dividing it by the replicas.

    Keras 3.8+ divides each reduced loss by the number of replicas in
    `keras.src.losses.loss.scale_loss_for_distribution`, but not a loss that
    is already a scalar before reduction (an output of shape `(batch,)`, a
    `Loss` whose `call` returns the batch mean), and Keras 3.6-3.7 divide
    none. Made the identity here (with its inverse, which per-output loss
    metrics use), every loss is this replica's own mean, whatever the Keras
    version or loss shape.
    """
    return replaced(keras_loss_module, {
        "scale_loss_for_distribution": identity,
        "unscale_loss_for_distribution": identity,
    })


@contextlib.contextmanager
def recording_loss_reductions(shape_ops, reduced=None):
    """Records how Keras reduces each loss computed inside the context.

    Wraps `keras.src.losses.loss.reduce_weighted_values`, the one place
    where a `keras.losses.Loss` (built-in, subclassed, or a plain function
    Keras wraps) reduces its per-element values, with the mask made by the
    loss itself (`ignore_class`) already merged with the prediction's. The
    returned list receives one `divisor.Reduction` per loss term, read
    through the backend's `shape_ops` (`divisor.ShapeOps`). With
    `reduced`, each reduced loss is replaced by `reduced(loss, record)`.
    """
    records = []
    original = keras_loss_module.reduce_weighted_values

    def recording(values, sample_weight=None, mask=None,
                  reduction="sum_over_batch_size", dtype=None):
        weight_sum = None
        if reduction == "mean_with_sample_weight" and (
            sample_weight is not None or mask is not None
        ):
            # Before Keras's own reduction, from a copy: Keras's
            # `apply_mask` multiplies the sample weights by the mask in
            # place, which on PyTorch would change a tensor the backward
            # pass needs.
            weight_sum = ops.sum(_merged_sample_weight(
                values, None if sample_weight is None
                else ops.copy(sample_weight), mask, reduction))
        loss = original(values, sample_weight=sample_weight, mask=mask,
                        reduction=reduction, dtype=dtype)
        loss_object, prediction = _calling_loss()
        records.append(divisor.reduction_of(
            values, reduction, shape_ops, mask, weight_sum,
            loss=loss_object, prediction=prediction,
            weighted=sample_weight is not None))
        return loss if reduced is None else reduced(loss, records[-1])

    with replaced(keras_loss_module, {"reduce_weighted_values": recording}):
        yield records


def _calling_loss():
    """The `Loss` whose `__call__` called the wrapped reduction (its
    `self`) and the prediction it was given, or (None, None):
    `Loss.__call__(self, y_true, y_pred, ...)` is its one caller in keras
    3.6-3.15.
    """
    caller = sys._getframe(2).f_locals
    loss = caller.get("self")
    if not isinstance(loss, keras_loss_module.Loss):
        return None, None
    return loss, caller.get("y_pred")


def _merged_sample_weight(values, sample_weight, mask, reduction):
    """Sample weights with the mask merged in, as Keras divides by them.

    Uses Keras's own `apply_mask` and `squeeze_or_expand_to_same_rank`
    (keras.src.losses.loss), so "mean_with_sample_weight" divides by what
    Keras divides by.
    """
    values = ops.convert_to_tensor(values)
    weights = keras_loss_module.apply_mask(
        sample_weight, mask, dtype=values.dtype, reduction=reduction
    )
    if weights is None:
        return ops.ones_like(values)
    weights = ops.cast(weights, values.dtype)
    _, weights = keras_loss_module.squeeze_or_expand_to_same_rank(
        values, weights
    )
    return ops.cast(weights, "float32")


def _value(variable):
    """A Keras variable's value as a tensor (summed over replicas: a cast
    reads a synchronised-on-read variable, which conversion hands back)."""
    return ops.cast(variable, "float32")
