"""Which Keras backend the suite runs on, and what only one backend has.

The promise's tests run on every backend accum_model supports
(`KERAS_BACKEND=tensorflow`, the default, `jax` or `torch`); a test of
something only one backend offers (TensorFlow's distribution strategies,
`tf.data`, Keras 2; JAX's `keras.distribution` and stateless step) is
marked with `tensorflow_only` or `jax_only`, and skipped elsewhere with
the reason; `not_on_jax` marks what JAX refuses (tested there).
"""

import keras
import pytest

BACKEND = keras.backend.backend()
ON_TENSORFLOW = BACKEND == "tensorflow"
ON_JAX = BACKEND == "jax"
ON_TORCH = BACKEND == "torch"


def tensorflow_only(reason):
    """Marks a test that needs the TensorFlow backend, saying why."""
    return pytest.mark.skipif(not ON_TENSORFLOW,
                              reason=f"TensorFlow backend only: {reason}")


def jax_only(reason):
    """Marks a test of something only the JAX backend has."""
    return pytest.mark.skipif(not ON_JAX, reason=f"JAX backend only: {reason}")


def not_on_jax(reason):
    """Marks a test of something the JAX backend refuses (tested there)."""
    return pytest.mark.skipif(ON_JAX, reason=f"not on JAX: {reason}")
