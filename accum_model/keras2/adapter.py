"""`Keras2Adapter`: Keras 2 (TensorFlow 2.13-2.15's own, or `tf_keras`).

The window is `accum_model.tensorflow`'s, as on Keras 3's TensorFlow; each
module named here says which Keras 2 versions it was checked on. Keras 2
executions stop between steps, and the loop ends data with
`tf.errors.OutOfRangeError`.
"""

import tensorflow as tf

from accum_model.core.adapter import Adapter
from accum_model.keras2 import learning_rate
from accum_model.keras2 import losses
from accum_model.keras2 import normalization
from accum_model.keras2 import optimizer
from accum_model.keras2 import saving
from accum_model.keras2 import loop
from accum_model.keras2.package import keras
from accum_model.tensorflow.train_step import TensorFlowSteps
from accum_model.tensorflow.accumulation import TensorFlowAccumulation


class Keras2Adapter(TensorFlowSteps, Adapter):
    """Keras 2 on TensorFlow."""

    # Its Adam applies repeated rows whole; its clipping does not (measured
    # on tf_keras 2.21.0, tests/test_large_batch_check.py).
    SPARSE_ROW_STRAYS = frozenset({"clipping"})
    # `LossesContainer` multiplies a summed loss's logged value by the
    # replicas (tf_keras 2.21.0, keras 2.13.1 `compile_utils`).
    SUMS_LOGGED_PER_REPLICA = True

    keras = keras
    Functional = saving.Functional
    Accumulation = TensorFlowAccumulation
    LossScaling = optimizer.Keras2LossScaling
    ModelDifferences = loop.Keras2ModelDifferences
    WindowCheckpoint = saving.Keras2WindowCheckpoint
    LOSS_REDUCTIONS = losses.LOSS_REDUCTIONS
    END_OF_DATA_ERRORS = (StopIteration, tf.errors.OutOfRangeError)

    losses = losses
    saving = saving
    learning_rate = learning_rate
    loop = loop
    optimizer = optimizer
    recording_loss_reductions = staticmethod(
        losses.recording_loss_reductions)
    recording_batch_statistics = staticmethod(
        normalization.recording_batch_statistics)
    foreign_variables_in_graph = staticmethod(
        loop.foreign_variables_in_graph)
    is_foreign_layer = staticmethod(loop.is_foreign_layer)

    @staticmethod
    def draws_random_numbers(layer):
        """Whether `layer` holds a random generator of its own: Keras 2's
        `BaseRandomLayer` (Dropout, GaussianNoise, a user's own random
        layer) keeps it in its private `_random_generator` (checked on keras
        2.13.1 and tf-keras 2.21.0)."""
        return getattr(layer, "_random_generator", None) is not None

    @staticmethod
    def writes_variables_per_micro_batch(layer, own_step):
        """Keras 2's `SpectralNormalization` renormalizes its kernel in each
        training call; the window leaves it to the layer."""
        del own_step
        spectral = getattr(keras.layers, "SpectralNormalization", None)
        return spectral is not None and isinstance(layer, spectral)

    @staticmethod
    def value_of_call(function, array):
        """Float. `function` of the NumPy `array` as a tensor, eagerly
        (read in float32, as bfloat16 converts to no NumPy type)."""
        return float(tf.cast(function(tf.constant(array)), tf.float32))

    @staticmethod
    def logs_for_reduction(logs, strategy):
        """Keras 2 reduces the step's scalar logs over workers itself."""
        del strategy
        return logs

    @staticmethod
    def check_strategy(model):
        loop.check_strategy(model)
