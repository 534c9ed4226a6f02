"""The compiled optimizer's duties, taken apart for windows.

A `LossScaleOptimizer` scales the loss, unscales the gradients, checks them
and applies them in one step. A window spans several micro steps, so those
duties are taken apart: each micro step scales its loss and unscales its
gradients into the accumulators, and the window end applies the unscaled
mean gradient with the *inner* optimizer, then moves the dynamic scale
exactly as the `LossScaleOptimizer` would after one step on the large batch.

Each Keras adapter's `LossScaling` subclasses `OptimizerDuties` and fills in
its Keras's way of doing each duty, with the same methods: `is_built`,
`build`, `apply`, `scale_loss`, `unscale_gradients`, `after_update`,
`after_overflow`, and the class attribute `clips_before_summing_replicas`.
"""


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
