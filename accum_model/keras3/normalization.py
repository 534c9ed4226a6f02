"""Which normalization layers a window takes the moving statistics of, and
how many elements a masked call's moments cover, on every Keras 3 backend.

Checked on keras 3.6.0, 3.10.0 and 3.15.1. Keras 3's `BatchNormalization`
(`keras.src.layers.normalization.batch_normalization`), in a training call
of a trainable layer without `renorm`, takes the batch's moments from its
private `_moments(inputs, mask)` and then moves `moving_mean` and
`moving_variance` once each; each backend's module (`tensorflow_normalization`,
`stateless_normalization`) records those moments and suppresses the moves.
Under a mask `_moments` weighs each element by it (`layer._reduction_axes`
are the axes it reduces).
"""

import keras
from keras import ops
from keras.src.backend.common.symbolic_scope import in_symbolic_scope


def pools_moving_statistics(layer):
    """Whether a window takes over `layer`'s moving statistics."""
    return (
        isinstance(layer, keras.layers.BatchNormalization)
        and type(layer).call is keras.layers.BatchNormalization.call
        and not getattr(layer, "renorm", False)
        and callable(getattr(layer, "_moments", None))
    )


def is_symbolic_call():
    """Whether a layer is called in Keras's symbolic pass (the shapes-only
    call `compute_output_spec` makes when a layer builds, inside the
    private `SymbolicScope`), whose moments are no micro-batch's."""
    return in_symbolic_scope()


def masked_element_counts(layer, inputs, mask):
    """Float32 [channels]: the elements each channel's moments cover, as
    `_moments` counts them under `mask` (one dimension less than the
    inputs, broadcast over the last axis): those it leaves in."""
    weights = ops.broadcast_to(
        ops.expand_dims(ops.cast(mask, "float32"), -1), ops.shape(inputs))
    return ops.reshape(ops.sum(weights, axis=tuple(layer._reduction_axes)),
                       [int(layer.moving_mean.shape[0])])
