"""The array operations of the backend-free window arithmetic on Keras 3's
JAX and PyTorch backends (`core.arithmetic.ArrayOps`,
`core.divisor.ShapeOps`), written with `keras.ops` so that one window runs
inside a jitted JAX step and eagerly on PyTorch."""

import math

import keras
from keras import ops

from accum_model.core import arithmetic
from accum_model.core import divisor


def to_float32(value):
    return ops.cast(value, "float32")


KERAS_OPS = arithmetic.ArrayOps(
    where=ops.where, minimum=ops.minimum, maximum=ops.maximum,
    zeros_like=ops.zeros_like, ones_like=ops.ones_like,
    to_float32=to_float32,
    sum=ops.sum, square=ops.square, abs=ops.abs, max=ops.max, all=ops.all,
    isfinite=ops.isfinite, cast=ops.cast, zeros=ops.zeros,
    dtype_name=lambda value: keras.backend.standardize_dtype(value.dtype),
)


KERAS_SHAPES = divisor.ShapeOps(
    convert=ops.convert_to_tensor,
    count=lambda value: to_float32(ops.size(value)),
    count_true=lambda mask: ops.sum(to_float32(mask)),
    first_dimension=lambda value: ops.shape(value)[0],
    leading_elements=lambda value: to_float32(
        math.prod(ops.shape(value)[:-1])),
    flatten=keras.tree.flatten,
    to_float32=to_float32,
)
