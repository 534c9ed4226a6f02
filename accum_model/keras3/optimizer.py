"""Keras 3's optimizers and mixed precision, on every backend.

Which weights a large batch differentiates in float16
(`float16_gradient_flags`), and the loss scaling every backend's micro step
does (`Keras3LossScaling`; the window end's own part is each backend's:
`tensorflow_optimizer`, `stateless_window`).
"""

from keras import ops
from keras import optimizers

from accum_model.core import class_tree
from accum_model.core.optimizer_duties import OptimizerDuties
from accum_model.core.variables import is_overwritten_with_gradient


class Keras3LossScaling(OptimizerDuties):
    """The compiled Keras 3 optimizer's loss scaling, taken apart for windows.

    Each micro step scales its loss by the `LossScaleOptimizer`'s dynamic
    scale S times its share of the window, and unscales its gradients by
    the same; a static `loss_scale_factor` multiplies the loss and the
    optimizer divides it out. Reads `dynamic_scale` and `initial_scale`
    (public), checked on keras 3.6.0, 3.10.0 and 3.15.1.

    Args:
        optimizer: The compiled optimizer, a `LossScaleOptimizer` or not.
    """

    # Keras 3's LossScaleOptimizer leaves `iterations` alone on a skip.
    counts_skipped_steps = False

    def __init__(self, optimizer):
        super().__init__(optimizer, optimizers.LossScaleOptimizer)

    def current_scale(self):
        """S as a float32 tensor (inside JAX's step, its traced value)."""
        lso = self.loss_scale_optimizer
        scale = lso.dynamic_scale if lso.built else lso.initial_scale
        return ops.cast(ops.convert_to_tensor(scale), "float32")

    def scale_loss(self, loss, share=1.0):
        factor = getattr(self.update_optimizer, "loss_scale_factor", None)
        if factor is not None:
            loss = loss * ops.cast(factor, loss.dtype)
        if not self.active:
            return loss
        return loss * ops.cast(self.current_scale() * share, loss.dtype)

    def unscale_gradients(self, gradients, variables=None, share=1.0):
        """Divides by S and the share, except where Keras overwrites a
        variable with its gradient (float8 statistics are not scaled)."""
        if not self.active:
            return gradients
        keep = [is_overwritten_with_gradient(v)
                for v in (variables or [None] * len(gradients))]
        return self._scaled(gradients, 1.0 / (self.current_scale() * share),
                            keep)

    @staticmethod
    def _scaled(gradients, factor, keep):
        """`gradients` times `factor`, but where `keep` says or a gradient
        is None."""
        return [g if kept or g is None else g * ops.cast(factor, g.dtype)
                for g, kept in zip(gradients, keep)]


def check_optimizer(optimizer, model):
    """Keras 3's optimizers all apply a window as one device applies the
    large batch: nothing to refuse or warn of (returns None)."""
    del optimizer, model
    return None


def float16_gradient_flags(model, variables):
    """For each of `variables`, whether the large batch's gradient of it is
    float16 (and so overflows above float16's range): a float16 variable's
    always is.

    A float32 variable read inside the call of a layer that computes in
    float16 is autocast to float16 there (`AutocastScope`), and its gradient
    is float16 until it is cast back. Keras marks the variables that may be
    autocast (`Variable._autocast`; BatchNormalization's are not) and the
    layers that autocast (`Layer.autocast`); a layer's own variables are its
    private `_trainable_variables`. Checked on keras 3.15.1.
    """
    autocast = set()
    for layer in class_tree.layers_of(model):
        if (getattr(layer, "autocast", True)
                and layer.compute_dtype == "float16"):
            autocast.update(
                id(v) for v in getattr(layer, "_trainable_variables", ()))
    return [
        v.dtype == "float16" or (
            id(v) in autocast and v.dtype == "float32"
            and getattr(v, "_autocast", True))
        for v in variables
    ]
