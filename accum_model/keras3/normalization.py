"""Keras 3's normalization layers as every backend's window sees them:
`BatchNormalization`'s moving statistics, pooled over the window, and
`SpectralNormalization`'s kernel, renormalized once per window.

Checked on keras 3.6.0, 3.10.0 and 3.15.1 (and, for JAX and PyTorch, with
jax 0.10.2 and torch 2.13.0): in a training call of a trainable layer
without `renorm`, the layer takes the batch's moments from its private
`_moments(inputs, mask)`, weighing each element by the mask over
`layer._reduction_axes`, then assigns `moving_mean` and `moving_variance`
once each. Each backend's module records those moments and keeps the
assigns from moving the statistics: `tensorflow_normalization`,
`stateless_normalization` (JAX) and `torch_normalization`. A layer of
either kind whose class overrides `call` is left alone.
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


def renormalizes_kernel(layer):
    """Whether `layer` is Keras's `SpectralNormalization`, whose training
    call renormalizes the kernel it wraps: it assigns `vector_u` and the
    kernel what its `normalized_weights()` returns, `(vector_u, kernel)`
    (checked on keras 3.6.0 and 3.15.1)."""
    return (isinstance(layer, keras.layers.SpectralNormalization)
            and type(layer).call is keras.layers.SpectralNormalization.call
            and callable(getattr(layer, "normalized_weights", None)))


def normalized_once_per_window(layer, writes_vector, writes_kernel=None):
    """`layer.normalized_weights` that gives `vector_u` and the kernel
    their new values only where `writes_vector()` and `writes_kernel()`
    hold (bool scalars read where the layer is called; None: always), and
    the weights as they are elsewhere.

    The large batch renormalizes once per step, and a window's weights do
    not change before its end: where the layer's writes persist, both are
    written in the window's first micro step only; where the kernel's do
    not (Keras's JAX step), the kernel is renormalized in every micro step
    from the same `vector_u`, written as the window closes.
    """
    original = type(layer).normalized_weights.__get__(layer)

    def normalized_weights():
        vector_u, kernel = original()
        if writes_kernel is not None:
            kernel = ops.where(writes_kernel(), kernel, layer.kernel.value)
        return ops.where(writes_vector(), vector_u,
                         layer.vector_u.value), kernel

    return normalized_weights
