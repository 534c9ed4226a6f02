"""The compiled optimizer's duties, taken apart for windows.

A `LossScaleOptimizer` scales the loss, unscales the gradients, checks them
and applies them in one step. A window spans several micro steps, so those
duties are taken apart: each micro step scales its loss and unscales its
gradients into the accumulators, and the window end applies the unscaled
mean gradient with the *inner* optimizer, then moves the dynamic scale
exactly as the `LossScaleOptimizer` would after one step on the large batch.

A micro-batch's loss is scaled by the dynamic scale times its share of the
window (1/(n*r) for a window of n on r replicas, each replica's loss being a
mean over its own part of the micro-batch), so that its per-sample terms in
the backward pass are the large batch's: a micro-batch overflows where the
large batch would, not earlier. Its gradients are unscaled by the inverse.
The window end also skips a window whose summed float16 gradient, scaled,
leaves float16's range where the large batch's would (`window.end_checks`).

Each Keras adapter's `LossScaling` subclasses `OptimizerDuties` and fills in
its Keras's way of doing each duty, with the same methods: `is_built`,
`build`, `apply`, `scale_loss`, `unscale_gradients`, `after_update`,
`after_overflow`, `summed_gradients` (see there), and the attributes
`applies_summed_gradients` (whether the optimizer can be kept from summing
gradients over replicas) and `counts_skipped_steps` (whether a window
skipped for overflow advances the optimizer's `iterations`, as that Keras's
`LossScaleOptimizer` does for a skipped step).
"""

import contextlib


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

    # Whether `apply` is inside `summed_gradients()`.
    gradients_are_summed = False

    @contextlib.contextmanager
    def summed_gradients(self):
        """Inside the block, `apply` takes gradients that every replica
        holds whole, and the optimizer does not sum them over replicas.

        Entered once around the per-replica calls (replicas may run in
        threads of their own), only if `applies_summed_gradients`.
        """
        self.gradients_are_summed = True
        try:
            with self._optimizer_sum_skipped():
                yield
        finally:
            self.gradients_are_summed = False

    def _optimizer_sum_skipped(self):
        """A context in which the optimizer does not sum over replicas (a
        Keras whose optimizer takes an argument for it needs none)."""
        return contextlib.nullcontext()
