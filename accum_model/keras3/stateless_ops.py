"""The array operations the backend-free window arithmetic runs with on JAX
(`core.arithmetic.ArrayOps`, `core.divisor.ShapeOps`)."""

import jax.numpy as jnp
import keras
import numpy as np

from accum_model.core import arithmetic
from accum_model.core import divisor

# Used by the JAX modules beside it; nothing of the adapter's own.
__all__ = []


JAX_OPS = arithmetic.ArrayOps(
    where=jnp.where, minimum=jnp.minimum, maximum=jnp.maximum,
    zeros_like=jnp.zeros_like, ones_like=jnp.ones_like,
    to_float32=lambda value: jnp.asarray(value, jnp.float32),
)


JAX_SHAPES = divisor.ShapeOps(
    convert=jnp.asarray,
    count=lambda value: jnp.asarray(jnp.size(value), jnp.float32),
    count_true=lambda mask: jnp.sum(jnp.asarray(mask, jnp.float32)),
    first_dimension=lambda value: jnp.shape(value)[0],
    leading_elements=lambda value: jnp.asarray(
        np.prod(jnp.shape(value)[:-1]), jnp.float32),
    flatten=keras.tree.flatten,
    to_float32=lambda value: jnp.asarray(value, jnp.float32),
)
