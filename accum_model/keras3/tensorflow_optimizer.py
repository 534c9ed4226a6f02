"""Keras 3's `LossScaleOptimizer` on TensorFlow, taken apart for windows.

Keras 3's `LossScaleOptimizer` scales the loss with `scale_loss()` and
unscales, checks and applies in one `apply()` call per step; the window
does each of those duties at its own point (see
`accum_model.core.optimizer_duties`). At the window end the inner optimizer
applies, and the dynamic scale moves by Keras's rule, written here with the
public `dynamic_scale`, `step_counter` and `dynamic_growth_steps` (checked
on keras 3.6.0, 3.10.0 and 3.15.1).

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

from accum_model.core import patch
from accum_model.keras3.optimizer import Keras3LossScaling
from accum_model.tensorflow.optimizer_duties import scaled_gradients


class TensorFlowLossScaling(Keras3LossScaling):
    """The compiled Keras 3 optimizer's duties on TensorFlow: loss scaling,
    and the apply and the dynamic scale's rule at the window end.

    Args:
        optimizer: The compiled optimizer, a `LossScaleOptimizer` or not.
    """

    @staticmethod
    def _scaled(gradients, factor, keep):
        # Sparse gradients (`tf.IndexedSlices`) scale their values.
        return scaled_gradients(gradients, factor, keep)

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
