"""The core's array operations in NumPy: the window's transitions run on
them in the core's own tests, with no Keras and no backend."""

import numpy as np

from accum_model.core.arithmetic import ArrayOps


def _cast(value, dtype):
    return np.asarray(value).astype(dtype)


def _zeros(shape, dtype):
    return np.zeros(shape, dtype)


def _divide_no_nan(numerator, denominator):
    numerator, denominator = np.asarray(numerator), np.asarray(denominator)
    safe = np.where(denominator == 0, np.ones_like(denominator), denominator)
    return np.where(denominator == 0, np.zeros_like(numerator),
                    numerator / safe).astype(numerator.dtype)


NUMPY_OPS = ArrayOps(
    where=np.where, minimum=np.minimum, maximum=np.maximum,
    zeros_like=np.zeros_like, ones_like=np.ones_like,
    to_float32=lambda value: _cast(value, "float32"),
    divide_no_nan=_divide_no_nan,
    sum=np.sum, square=np.square, abs=np.abs, max=np.max, all=np.all,
    isfinite=np.isfinite, cast=_cast, zeros=_zeros,
    dtype_name=lambda value: np.asarray(value).dtype.name,
)
