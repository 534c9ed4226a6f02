"""Keras 3's `LossScaleOptimizer` on TensorFlow, taken apart for windows.

Keras 3's `LossScaleOptimizer` scales the loss with `scale_loss()` and
unscales, checks and applies in one `apply()` call per step; `LossScaling`
does each of those duties at its own point of the window (see
`accum_model.tensorflow.optimizer_duties`). Reads `dynamic_scale`, `step_counter`,
`dynamic_growth_steps` and `initial_scale` (public attributes, checked on
keras 3.6.0, 3.10.0 and 3.15.1).

The window end sums the window gradient over replicas itself, in the same
collective as its totals, and applies it through the private
`_all_reduce_sum_gradients` hook of Keras's TensorFlow optimizer (its
`_backend_update_step` sums each replica's gradients through it, after
clipping them): replaced by the identity for the length of the apply, the
optimizer neither sums a second time nor clips a replica's share. Checked
on keras 3.6.0, 3.10.0 and 3.15.1.
"""

import contextlib

import tensorflow as tf
from keras import optimizers

from accum_model.core import patch
from accum_model.core.optimizer_duties import OptimizerDuties
from accum_model.core.variables import is_overwritten_with_gradient
from accum_model.tensorflow.optimizer_duties import scaled_gradients

class TensorFlowLossScaling(OptimizerDuties):
    """The compiled Keras 3 optimizer's duties: loss scaling and apply.

    Args:
        optimizer: The compiled optimizer, a `LossScaleOptimizer` or not.
    """

    # Keras 3's LossScaleOptimizer leaves `iterations` alone on a skip.
    counts_skipped_steps = False

    def __init__(self, optimizer):
        super().__init__(optimizer, optimizers.LossScaleOptimizer)

    def is_built(self):
        return self.optimizer.built

    def build(self, variables):
        self.optimizer.build(variables)

    @property
    def applies_summed_gradients(self):
        """Whether `summed_gradients()` can keep the optimizer from summing
        over replicas (its TensorFlow optimizer has the hook)."""
        return callable(getattr(self.update_optimizer, _REPLICA_SUM, None))

    def apply(self, gradients, variables):
        self.update_optimizer.apply(gradients, variables)

    def _optimizer_sum_skipped(self):
        return _replica_sum_skipped(self.update_optimizer)

    def current_scale(self):
        """The scale in force now, as a float32 tensor."""
        lso = self.loss_scale_optimizer
        if lso.built:
            return tf.convert_to_tensor(lso.dynamic_scale, tf.float32)
        return tf.constant(lso.initial_scale, tf.float32)

    def scale_loss(self, loss, share=1.0):
        """The loss times any static `loss_scale_factor`, and times the
        dynamic scale and the micro-batch's `share` of the window under a
        `LossScaleOptimizer`."""
        # A static `loss_scale_factor` on the optimizer: its `apply` divides
        # the gradients by it, so the loss must be multiplied by it here.
        factor = getattr(self.update_optimizer, "loss_scale_factor", None)
        if factor is not None:
            loss = loss * tf.cast(factor, loss.dtype)
        if not self.active:
            return loss
        return loss * tf.cast(self.current_scale() * share, loss.dtype)

    def unscale_gradients(self, gradients, variables=None, share=1.0):
        """Divides by the dynamic scale and the share, except where Keras
        overwrites a variable with its gradient (float8 statistics are not
        scaled)."""
        if not self.active:
            return gradients
        keep = [
            is_overwritten_with_gradient(v)
            for v in (variables or [None] * len(gradients))
        ]
        return scaled_gradients(
            gradients, 1.0 / (self.current_scale() * share), keep
        )

    def after_update(self):
        """Counts one applied update; doubles the scale every growth period."""
        lso = self.loss_scale_optimizer
        if lso is None:
            return

        def grow():
            lso.step_counter.assign(0)
            lso.dynamic_scale.assign(lso.dynamic_scale * 2.0)

        def count():
            lso.step_counter.assign_add(1)

        tf.cond(
            tf.equal(lso.step_counter, lso.dynamic_growth_steps - 1),
            grow,
            count,
        )

    def after_overflow(self):
        """Halves the scale once and restarts the growth period."""
        lso = self.loss_scale_optimizer
        if lso is None:
            return
        lso.step_counter.assign(0)
        lso.dynamic_scale.assign(lso.dynamic_scale * 0.5)


_REPLICA_SUM = "_all_reduce_sum_gradients"


@contextlib.contextmanager
def _replica_sum_skipped(optimizer):
    """Inside the block, `optimizer` applies each replica's gradients as
    they are (its hook returns the (gradient, variable) pairs unchanged)."""
    setattr(optimizer, _REPLICA_SUM, patch.identity)
    try:
        yield
    finally:
        delattr(optimizer, _REPLICA_SUM)
