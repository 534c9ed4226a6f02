"""Keras 2's `LossScaleOptimizer` and optimizers, taken apart for windows.

The window end sums the window gradient over replicas itself, in the same
collective as its totals, and applies it with the public
`apply_gradients(..., skip_gradients_aggregation=True)` (legacy optimizers:
`experimental_aggregate_gradients=False`), so the optimizer does not sum it
a second time. `LossScaleOptimizer.get_scaled_loss` /
`get_unscaled_gradients` are the hooks, and the dynamic scale lives in a
private `_DynamicLossScaleState` whose own `update` rule is reused. Legacy
optimizers (`optimizers.legacy`) are built through the private
`_create_all_weights`. Checked on tf_keras 2.21.0 / TF 2.21.0, keras 2.15.0
/ TF 2.15.1 and keras 2.13.1 / TF 2.13.1.
"""

import tensorflow as tf

from accum_model.core import class_tree
from accum_model.core.optimizer_duties import OptimizerDuties
from accum_model.keras2.package import keras
from accum_model.keras2.package import src
from accum_model.tensorflow.optimizer_duties import scaled_gradients

_optimizer_v2 = src("optimizers.legacy.optimizer_v2")
_autocast_variable = src("mixed_precision.autocast_variable")


def float16_gradient_flags(model, variables):
    """For each of `variables`, whether the large batch's gradient of it is
    float16 (and so overflows above float16's range): a float16 variable's
    always is.

    Keras 2 wraps the float32 variables of a layer computing in float16 in
    an `AutoCastVariable`, read as float16 inside the layer's call (unless
    the layer's private `_autocast` is off); its gradient is float16 until
    cast back. A layer's own variables are its private `_trainable_weights`.
    Checked on tf_keras 2.21.0.
    """
    autocast = set()
    for layer in class_tree.layers_of(model):
        if (getattr(layer, "_autocast", True)
                and layer.compute_dtype == "float16"):
            autocast.update(
                id(v) for v in getattr(layer, "_trainable_weights", ()))
    return [
        v.dtype == tf.float16 or (
            id(v) in autocast
            and isinstance(v, _autocast_variable.AutoCastVariable))
        for v in variables
    ]


def check_optimizer(optimizer, model):
    """Refuses a legacy optimizer (`optimizers.legacy`) under replicas, and
    names Nadam there.

    Under MirroredStrategy a legacy optimizer weighed the replicas' window
    gradients unlike one device where micro-batches split unevenly (tf_keras
    2.21, two replicas, 97 samples in micro-batches of 8: 3.0e-2 from one
    device, the new optimizer 3e-8); on one replica it is exact.

    Keras 2's Nadam keeps the count of its `_u_product` updates in a Python
    number (`_u_product_counter`) that advances while a step is traced, not
    while it runs. Under MirroredStrategy the update is traced once for each
    replica's copy, so each copy of `_u_product` moves a different number of
    times (tf_keras 2.21, two replicas, 14 steps of a Dense: 6.6e-14 and
    4.0e-14, one device 1.1e-13) and so do the weights it scales: plain
    Keras and a window alike land 8e-7 from one device's weights, 6e-5 on
    an Embedding. No window can undo it.

    Returns:
        A warning's text, or None.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    replicas = model.distribute_strategy.num_replicas_in_sync
    if replicas == 1:
        return None
    name = type(inner).__name__
    if isinstance(inner, _optimizer_v2.OptimizerV2):
        raise ValueError(
            f"AccumulatingModel cannot apply a legacy optimizer "
            f"(`tf.keras.optimizers.legacy.{name}`) exactly under "
            f"{replicas} replicas. Use `tf.keras.optimizers.{name}`, which "
            "it applies like one device, or train on one replica. Received: "
            f"optimizer={name} (legacy), {replicas} replicas"
        )
    if isinstance(inner, keras.optimizers.Nadam):
        return (
            f"Keras 2's Nadam does not update like one device under "
            f"{replicas} replicas: it counts its `_u_product` updates when "
            "a step is traced, once for each replica's copy, so each copy "
            "moves its own way, and the weights with it. Plain Keras and "
            "AccumulatingModel alike land away from one device's Nadam "
            "(8e-7 on a Dense after 14 steps, 6e-5 on an Embedding). For "
            "one device's numbers, train on one replica, or use another "
            "optimizer (Adam is exact under replicas). Received: "
            f"optimizer=Nadam, {replicas} replicas"
        )
    return None


class Keras2LossScaling(OptimizerDuties):
    """The compiled Keras 2 optimizer's duties: loss scaling and apply.

    Each micro step scales its loss with the `LossScaleOptimizer`'s own
    `get_scaled_loss` and unscales its gradients with its own
    `get_unscaled_gradients`; the window end applies the unscaled window
    gradient with the inner optimizer and moves the dynamic scale by
    Keras's own rule, once per window.

    Args:
        optimizer: The compiled optimizer, a `LossScaleOptimizer` or not.
    """

    # Keras 2's LossScaleOptimizer (legacy and new) adds 1 to the inner
    # optimizer's `iterations` on a skipped step: schedules and Adam's bias
    # correction move on.
    counts_skipped_steps = True

    def __init__(self, optimizer):
        super().__init__(optimizer, keras.mixed_precision.LossScaleOptimizer)

    def scale_loss(self, loss, share=1.0):
        """The loss times the dynamic scale and the micro-batch's `share` of
        the window under a `LossScaleOptimizer`."""
        if not self.active:
            return loss
        return self.loss_scale_optimizer.get_scaled_loss(
            loss * tf.cast(share, loss.dtype)
        )

    def unscale_gradients(self, gradients, variables=None, share=1.0):
        """Divides by the dynamic scale and the share."""
        del variables  # Keras 2 has no variables it overwrites with gradients.
        if not self.active:
            return gradients
        unscaled = self.loss_scale_optimizer.get_unscaled_gradients(gradients)
        return scaled_gradients(unscaled, 1.0 / share)

    def current_scale(self):
        """The scale in force now, as a float32 tensor."""
        return tf.cast(self.loss_scale_optimizer.loss_scale, tf.float32)

    def _dynamic_state(self):
        lso = self.loss_scale_optimizer
        if lso is None or not lso.dynamic:
            return None
        # Private: `_DynamicLossScaleState`, with Keras's update rule.
        return lso._loss_scale

    def after_update(self):
        """Counts one applied update; doubles the scale every growth period."""
        state = self._dynamic_state()
        if state is not None:
            state.update([tf.constant(1.0)])

    def after_overflow(self):
        """Halves the scale (not below 1), restarts the growth period, and
        counts the skipped step in `iterations` as Keras 2's
        `LossScaleOptimizer` does (its `do_not_apply_fn`)."""
        if self.active:
            self.update_optimizer.iterations.assign_add(1)
        state = self._dynamic_state()
        if state is not None:
            state.update([tf.constant(float("inf"))])

    def is_built(self):
        optimizer = self.update_optimizer
        if isinstance(optimizer, _optimizer_v2.OptimizerV2):
            return False  # Legacy optimizers make slots on demand.
        return bool(getattr(optimizer, "_built", False))

    def build(self, variables):
        optimizer = self.update_optimizer
        if isinstance(optimizer, _optimizer_v2.OptimizerV2):
            optimizer._create_all_weights(variables)
        else:
            optimizer.build(variables)

    # Both kinds of optimizer take a public argument for gradients already
    # summed over replicas.
    applies_summed_gradients = True

    def apply(self, gradients, variables):
        optimizer = self.update_optimizer
        pairs = list(zip(gradients, variables))
        if not self.gradients_are_summed:
            optimizer.apply_gradients(pairs)
        elif isinstance(optimizer, _optimizer_v2.OptimizerV2):
            optimizer.apply_gradients(
                pairs, experimental_aggregate_gradients=False)
        else:
            optimizer.apply_gradients(pairs, skip_gradients_aggregation=True)
