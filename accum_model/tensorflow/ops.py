"""TensorFlow's operations for the backend-free arithmetic of the core."""

import tensorflow as tf

from accum_model.core.arithmetic import ArrayOps
from accum_model.core.divisor import ShapeOps


def _to_float32(value):
    return tf.cast(value, tf.float32)


def _squared_norm(value):
    """Float32 |value|^2; a sparse gradient's repeated rows summed first."""
    if isinstance(value, tf.IndexedSlices):
        indices, positions = tf.unique(value.indices)
        value = tf.math.unsorted_segment_sum(
            tf.cast(value.values, tf.float32), positions, tf.shape(indices)[0])
    return tf.reduce_sum(tf.square(tf.cast(value, tf.float32)))


TF_OPS = ArrayOps(
    where=tf.where, minimum=tf.minimum, maximum=tf.maximum,
    zeros_like=tf.zeros_like, ones_like=tf.ones_like, to_float32=_to_float32,
    divide_no_nan=tf.math.divide_no_nan,
    sum=tf.reduce_sum, square=tf.square, abs=tf.abs, max=tf.reduce_max,
    all=tf.reduce_all, isfinite=tf.math.is_finite, cast=tf.cast,
    zeros=tf.zeros, dtype_name=lambda value: value.dtype.name,
    squared_norm=_squared_norm,
)

TF_SHAPES = ShapeOps(
    convert=tf.convert_to_tensor,
    count=lambda value: _to_float32(tf.size(value)),
    count_true=lambda mask: tf.reduce_sum(_to_float32(mask)),
    first_dimension=lambda value: tf.shape(value)[0],
    leading_elements=lambda value: _to_float32(
        tf.reduce_prod(tf.shape(value)[:-1])),
    flatten=tf.nest.flatten,
    to_float32=_to_float32,
)
