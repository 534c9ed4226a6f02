"""Which Keras backend the suite runs on, and what only TensorFlow has.

The promise's tests run on every backend accum_model supports
(`KERAS_BACKEND=tensorflow`, the default, or `jax`); a test of something
only the TensorFlow backend offers (its distribution strategies, `tf.data`,
Keras 2, mixed-float16 loss scaling on JAX not yet) is marked with
`tensorflow_only`, and skipped elsewhere with the reason.
"""

import keras
import pytest

BACKEND = keras.backend.backend()
ON_TENSORFLOW = BACKEND == "tensorflow"


def tensorflow_only(reason):
    """Marks a test that needs the TensorFlow backend, saying why."""
    return pytest.mark.skipif(not ON_TENSORFLOW,
                              reason=f"TensorFlow backend only: {reason}")
