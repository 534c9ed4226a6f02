"""The Keras 2 package behind `tf.keras`, and its private modules.

Keras 2 is `tf_keras` (with `TF_USE_LEGACY_KERAS=1`) or TensorFlow
2.13-2.15's own `keras`; both keep their code under `<package>.src`.
"""

import importlib

import tensorflow as tf

# The package behind `tf.keras`, as TensorFlow chose it: tf_keras (with
# TF_USE_LEGACY_KERAS=1) or, on TensorFlow 2.13-2.15, keras.
keras = importlib.import_module(tf.keras.Model.__module__.split(".")[0])


def src(module):
    """The private module `<package>.src.<module>` of that Keras 2."""
    return importlib.import_module(f"{keras.__name__}.src.{module}")
