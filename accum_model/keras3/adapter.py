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

    compute_loss = staticmethod(losses.compute_loss)
    get_keras_mask = staticmethod(losses.get_keras_mask)
    logged_loss_totals = staticmethod(losses.logged_loss_totals)
    loss_logged_by_window = staticmethod(losses.loss_logged_by_window)
    losses_not_divided_by_replicas = staticmethod(
        losses.losses_not_divided_by_replicas)
    track_loss = staticmethod(losses.track_loss)
    pools_moving_statistics = staticmethod(
        normalization.pools_moving_statistics)
    float16_gradient_flags = staticmethod(optimizer.float16_gradient_flags)
    learning_rate_of = staticmethod(learning_rate.learning_rate_of)
    scalable_learning_rate = staticmethod(
        learning_rate.scalable_learning_rate)
    clones_through_constructor = staticmethod(
        saving.clones_through_constructor)
    functional_constructor_signature = staticmethod(
        saving.functional_constructor_signature)
    register_plain_name = staticmethod(saving.register_plain_name)
    serialize_as = staticmethod(saving.serialize_as)
    unsafe_deserialization = staticmethod(saving.unsafe_deserialization)
    compiled_state_hidden = staticmethod(saving.compiled_state_hidden)
    wrap_sequential_cloning = staticmethod(saving.wrap_sequential_cloning)
    micro_steps_in_epoch = staticmethod(loop.micro_steps_in_epoch)
    model_keyword_arguments = staticmethod(loop.model_keyword_arguments)
    steps_per_execution = staticmethod(loop.steps_per_execution)

    @staticmethod
    def value_of_call(function, array):
        """Float. `function` of the NumPy `array` as a tensor, eagerly."""
        ops = keras.ops
        return float(ops.convert_to_numpy(function(
            ops.convert_to_tensor(array))))

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
