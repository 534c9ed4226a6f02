"""Everything that knows about Keras 3's `LossScaleOptimizer`.

Keras 2's counterpart is `_keras2_private.LossScaling`, with the same
methods.

Keras 3's `LossScaleOptimizer` scales the loss with `scale_loss()` and
unscales, checks and applies in one `apply()` call per step. A window spans
several micro steps, so accum_model takes those duties apart: each micro
step scales its loss and unscales its gradients into float32 accumulators,
and the window end applies the unscaled mean gradient with the *inner*
optimizer, then updates the dynamic scale exactly as `LossScaleOptimizer`
would after one step on the large batch.
"""

import tensorflow as tf

from accum_model._accumulator import is_overwritten_with_gradient


class OptimizerDuties:
    """The compiled optimizer, split into its loss scaler and its updater.

    Args:
        optimizer: The compiled optimizer.
        loss_scale_optimizer_class: The Keras's `LossScaleOptimizer` class.
    """

    def __init__(self, optimizer, loss_scale_optimizer_class):
        self.optimizer = optimizer
        if isinstance(optimizer, loss_scale_optimizer_class):
            self.loss_scale_optimizer = optimizer
            self.update_optimizer = optimizer.inner_optimizer
        else:
            self.loss_scale_optimizer = None
            self.update_optimizer = optimizer

    @property
    def active(self):
        """Whether the loss is scaled (a `LossScaleOptimizer` is compiled)."""
        return self.loss_scale_optimizer is not None


class LossScaling(OptimizerDuties):
    """The compiled Keras 3 optimizer's duties: loss scaling and apply.

    Args:
        optimizer: The compiled optimizer, a `LossScaleOptimizer` or not.
    """

    # Keras 3 optimizers clip each replica's gradients, then sum them.
    clips_before_summing_replicas = True

    def __init__(self, optimizer):
        # Imported here: a Keras 2 process uses only `OptimizerDuties` from
        # this module and must not import Keras 3 at start-up.
        from keras import optimizers

        super().__init__(optimizer, optimizers.LossScaleOptimizer)

    def is_built(self):
        return self.optimizer.built

    def build(self, variables):
        self.optimizer.build(variables)

    def apply(self, gradients, variables):
        self.update_optimizer.apply(gradients, variables)

    def current_scale(self):
        """The scale in force now, as a float32 tensor."""
        lso = self.loss_scale_optimizer
        if lso.built:
            return tf.convert_to_tensor(lso.dynamic_scale, tf.float32)
        return tf.constant(lso.initial_scale, tf.float32)

    def scale_loss(self, loss):
        # A static `loss_scale_factor` on the optimizer: its `apply` divides
        # the gradients by it, so the loss must be multiplied by it here.
        factor = getattr(self.update_optimizer, "loss_scale_factor", None)
        if factor is not None:
            loss = loss * tf.cast(factor, loss.dtype)
        if not self.active:
            return loss
        return loss * tf.cast(self.current_scale(), loss.dtype)

    def unscale_gradients(self, gradients, variables=None):
        """Divides by the dynamic scale, except where Keras overwrites a
        variable with its gradient (float8 statistics are not scaled)."""
        if not self.active:
            return gradients
        inverse = 1.0 / self.current_scale()
        overwrite = [
            is_overwritten_with_gradient(v)
            for v in (variables or [None] * len(gradients))
        ]
        return [
            g if g is None or kept else g * tf.cast(inverse, g.dtype)
            for g, kept in zip(gradients, overwrite)
        ]

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
