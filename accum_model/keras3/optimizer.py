"""Keras 3's optimizers and mixed precision, on every backend.

Which weights a large batch differentiates in float16 (`float16_gradient_flags`)
and which optimizers a window applies. The `LossScaleOptimizer` taken apart
for windows is each backend's (`tensorflow_optimizer`, `jax_training`).
"""


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
