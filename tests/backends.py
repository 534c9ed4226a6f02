"""Which Keras backend the suite runs on, and what only one backend has.

The promise's tests run on every backend accum_model supports
(`KERAS_BACKEND=tensorflow`, the default, `jax` or `torch`); a test of
something only one backend offers (TensorFlow's distribution strategies,
`tf.data`, Keras 2; JAX's `keras.distribution` and stateless step) is
marked with `tensorflow_only` or `jax_only`, and skipped elsewhere with
the reason; `not_on_jax` marks what JAX refuses (tested there).

Under Keras 2 (`TF_USE_LEGACY_KERAS=1` with tf_keras, or TensorFlow
2.13-2.15's own Keras) a topic file's tests run where they are marked
`keras_2_too` and are skipped otherwise; a test file that runs there takes
its Keras from `helpers.keras`, the Keras the model trains with.
"""

import functools

import keras
import pytest

from accum_model._chooser import KERAS_MAJOR

BACKEND = keras.backend.backend()
ON_TENSORFLOW = BACKEND == "tensorflow"
ON_JAX = BACKEND == "jax"
ON_TORCH = BACKEND == "torch"
ON_KERAS_2 = KERAS_MAJOR == 2


@functools.lru_cache(maxsize=None)
def two_replicas_distribution():
    """A distribution over two devices of this process, or a reason there
    is none: a MirroredStrategy over the two logical CPUs on TensorFlow,
    `keras.distribution.DataParallel` over two CPU devices on JAX.

    One instance serves the whole process: with a second strategy, a later
    test's collective ops failed with "Shape mismatch in the collective
    instance" against an earlier one's gradient shapes.
    """
    if ON_TORCH:
        return "Keras 3 has no data-parallel fit() on PyTorch"
    if ON_JAX:
        import jax

        devices = jax.devices()
        if len(devices) < 2:
            return ("needs two JAX devices (XLA_FLAGS="
                    "--xla_force_host_platform_device_count=2)")
        return keras.distribution.DataParallel(devices=devices[:2])
    import tensorflow as tf

    if len(tf.config.list_logical_devices("CPU")) < 2:
        return "needs two logical CPU devices (tests/conftest.py)"
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


# Marks a test of a topic file that runs under Keras 2 too.
keras_2_too = pytest.mark.keras_2_too


def keras_3_only(reason):
    """Marks a test of a file that runs under Keras 2 as Keras 3's only."""
    return pytest.mark.skipif(ON_KERAS_2, reason=f"Keras 3 only: {reason}")


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
