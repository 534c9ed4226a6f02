"""`Keras3Adapter`: what Keras 3 answers alike on every backend.

Each backend's subclass adds its training step and window
(`tensorflow_adapter.TensorFlowAdapter`, `jax_adapter.JaxAdapter`,
`torch_adapter.TorchAdapter`); each module named here says which Keras 3
versions its private details were checked on.
"""

import keras
from keras.src.models.functional import Functional

from accum_model.core.adapter import Adapter
from accum_model.keras3 import learning_rate
from accum_model.keras3 import losses
from accum_model.keras3 import normalization
from accum_model.keras3 import optimizer
from accum_model.keras3 import saving
from accum_model.keras3 import loop


class Keras3Adapter(Adapter):
    """Keras 3, whatever the backend."""

    keras = keras
    Functional = Functional
    LOSS_REDUCTIONS = losses.LOSS_REDUCTIONS

    losses = losses
    saving = saving
    learning_rate = learning_rate
    loop = loop
    optimizer = optimizer

    @staticmethod
    def pools_moving_statistics(layer):
        return normalization.pools_moving_statistics(layer)

    @staticmethod
    def value_of_call(function, array):
        """Float. `function` of the NumPy `array` as a tensor, eagerly
        (read in float32: TensorFlow converts no bfloat16 tensor to
        NumPy)."""
        ops = keras.ops
        return float(ops.convert_to_numpy(ops.cast(function(
            ops.convert_to_tensor(array)), "float32")))

    @staticmethod
    def draws_random_numbers(layer):
        """Whether `layer` holds a random generator of its own: Keras 3
        tracks every `SeedGenerator` a layer is given in its private
        `_seed_generators` (checked on keras 3.6.0 and 3.15.1)."""
        return bool(getattr(layer, "_seed_generators", ()))

    @staticmethod
    def writes_variables_per_micro_batch(layer, own_step):
        """`SpectralNormalization` renormalizes once per window in the
        built-in step; under a step of the user's own, in every call."""
        return own_step and normalization.renormalizes_kernel(layer)
