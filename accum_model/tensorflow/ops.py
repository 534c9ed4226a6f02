"""TensorFlow's `ArrayOps`, for the window's arithmetic."""

import tensorflow as tf

from accum_model.core.arithmetic import ArrayOps

TF_OPS = ArrayOps(
    where=tf.where, minimum=tf.minimum, maximum=tf.maximum,
    zeros_like=tf.zeros_like, ones_like=tf.ones_like,
    to_float32=lambda value: tf.cast(value, tf.float32),
)
