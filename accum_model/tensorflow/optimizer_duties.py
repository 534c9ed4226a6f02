"""Scaling TensorFlow gradients, dense or sparse, for loss scaling.

The optimizer's duties themselves (`OptimizerDuties`) are backend-free:
`accum_model.core.optimizer_duties`.
"""

import tensorflow as tf


def scaled_gradients(gradients, factor, keep=None):
    """`gradients` multiplied by the scalar `factor`.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or None.
        factor: Float scalar tensor.
        keep: Optional list of bools, True where a gradient is left as it is.
    """
    keep = keep or [False] * len(gradients)
    result = []
    for gradient, kept in zip(gradients, keep):
        if gradient is None or kept:
            result.append(gradient)
        elif isinstance(gradient, tf.IndexedSlices):
            result.append(tf.IndexedSlices(
                gradient.values * tf.cast(factor, gradient.values.dtype),
                gradient.indices, gradient.dense_shape,
            ))
        else:
            result.append(gradient * tf.cast(factor, gradient.dtype))
    return result
