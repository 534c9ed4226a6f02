"""Keras 3's optimizers and mixed precision, on every backend.

Which weights a large batch differentiates in float16 (`float16_gradient_flags`)
and which optimizers a window applies. The `LossScaleOptimizer` taken apart
for windows is each backend's (`tensorflow_optimizer`, `jax_training`).
"""

import numpy as np

__all__ = ["check_optimizer", "float16_gradient_flags", "learning_rate_of",
           "set_learning_rate"]


def check_optimizer(optimizer, model):
    """Every Keras 3 optimizer is applied exactly under every strategy."""
    del optimizer, model


def float16_gradient_flags(model, variables):
    """For each of `variables`, whether the large batch's gradient of it is
    float16 (and so overflows above float16's range).

    A float32 variable read inside the call of a layer that computes in
    float16 is autocast to float16 there (`AutocastScope`), and its gradient
    is float16 until it is cast back. Keras marks the variables that may be
    autocast (`Variable._autocast`; BatchNormalization's are not) and the
    layers that autocast (`Layer.autocast`); a layer's own variables are its
    private `_trainable_variables`. Checked on keras 3.15.1.
    """
    autocast = set()
    for layer in [model] + list(model._flatten_layers(include_self=False)):
        if (getattr(layer, "autocast", True)
                and layer.compute_dtype == "float16"):
            autocast.update(
                id(v) for v in getattr(layer, "_trainable_variables", ()))
    return [
        id(v) in autocast and v.dtype == "float32"
        and getattr(v, "_autocast", True)
        for v in variables
    ]


def learning_rate_of(optimizer):
    """The float learning rate `optimizer` (or, under loss scaling, the
    optimizer it wraps) applies, or None where it follows a schedule or a
    callable."""
    variable = _learning_rate_variable(optimizer)
    return None if variable is None else float(np.asarray(variable.numpy()))


def set_learning_rate(optimizer, value):
    """Sets a float learning rate (see `learning_rate_of`), eagerly."""
    _learning_rate_variable(optimizer).assign(value)


def _learning_rate_variable(optimizer):
    """The variable holding a float learning rate (private `_learning_rate`,
    a schedule or a callable otherwise), or None. Checked on keras 3.6.0,
    3.10.0 and 3.15.1."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    value = getattr(inner, "_learning_rate", None)
    return value if hasattr(value, "assign") else None
