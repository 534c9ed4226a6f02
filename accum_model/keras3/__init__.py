"""The Keras 3 adapter: every Keras 3 detail accum_model relies on.

`accum_model.keras2` offers the same names (`__all__`) for Keras 2; the
model layer is written once against them and reaches this package only
through `accum_model._chooser`. Most modules here hold on every Keras 3
backend; the training step, the window's state and saving are each
backend's, and this package picks them as Keras picks its backend
(`keras/src/backend/__init__.py`): `tensorflow_*` modules on TensorFlow,
`jax_training` and `jax_window` on JAX, `torch_training` on PyTorch
(the last two sharing `stateless_window`). Each module says which Keras 3 versions its private
details were checked on.
"""

import keras

from accum_model.keras3.losses import LOSS_REDUCTIONS
from accum_model.keras3.losses import compute_loss
from accum_model.keras3.losses import get_keras_mask
from accum_model.keras3.losses import logged_loss_totals
from accum_model.keras3.losses import loss_logged_by_window
from accum_model.keras3.losses import losses_not_divided_by_replicas
from accum_model.keras3.losses import recording_loss_reductions
from accum_model.keras3.losses import track_loss
from accum_model.keras3.normalization import pools_moving_statistics
from accum_model.keras3.optimizer import check_optimizer
from accum_model.keras3.optimizer import float16_gradient_flags
from accum_model.keras3.learning_rate import learning_rate_of
from accum_model.keras3.learning_rate import scalable_learning_rate
from accum_model.keras3.saving import Functional
from accum_model.keras3.saving import clones_through_constructor
from accum_model.keras3.saving import functional_constructor_signature
from accum_model.keras3.saving import register_plain_name
from accum_model.keras3.saving import serialize_as
from accum_model.keras3.saving import wrap_sequential_cloning
from accum_model.keras3.training import layers_of
from accum_model.keras3.training import micro_steps_in_epoch
from accum_model.keras3.training import model_keyword_arguments
from accum_model.keras3.training import steps_per_execution

from accum_model.keras3.training import BACKEND

if BACKEND == "jax":
    from accum_model.keras3.jax_training import END_OF_DATA_ERRORS
    from accum_model.keras3.jax_training import STEPS_PER_EXECUTION_FIX
    from accum_model.keras3.jax_window import Accumulation
    from accum_model.keras3.jax_window import LossScaling
    from accum_model.keras3.jax_training import ModelDifferences
    from accum_model.keras3.jax_window import WindowCheckpoint
    from accum_model.keras3.jax_training import accumulate_gradients
    from accum_model.keras3.jax_training import accumulating_train_step
    from accum_model.keras3.jax_training import batch_split_ways
    from accum_model.keras3.jax_training import check_strategy
    from accum_model.keras3.jax_training import default_micro_batch_weight
    from accum_model.keras3.jax_training import (
        executions_stop_cleanly_at_end_of_data)
    from accum_model.keras3.jax_training import foreign_variables_in_graph
    from accum_model.keras3.jax_training import is_foreign_layer
    from accum_model.keras3.jax_training import logs_for_reduction
    from accum_model.keras3.jax_training import recording_batch_statistics
    from accum_model.keras3.jax_training import replicas_in_sync
    from accum_model.keras3.jax_training import (
        stateless_accumulate_gradients)
elif BACKEND == "torch":
    from accum_model.keras3.torch_training import END_OF_DATA_ERRORS
    from accum_model.keras3.torch_training import STEPS_PER_EXECUTION_FIX
    from accum_model.keras3.torch_training import Accumulation
    from accum_model.keras3.torch_training import LossScaling
    from accum_model.keras3.torch_training import ModelDifferences
    from accum_model.keras3.torch_training import WindowCheckpoint
    from accum_model.keras3.torch_training import accumulate_gradients
    from accum_model.keras3.torch_training import accumulating_train_step
    from accum_model.keras3.torch_training import batch_split_ways
    from accum_model.keras3.torch_training import check_strategy
    from accum_model.keras3.torch_training import default_micro_batch_weight
    from accum_model.keras3.torch_training import (
        executions_stop_cleanly_at_end_of_data)
    from accum_model.keras3.torch_training import foreign_variables_in_graph
    from accum_model.keras3.torch_training import is_foreign_layer
    from accum_model.keras3.torch_training import logs_for_reduction
    from accum_model.keras3.torch_training import recording_batch_statistics
    from accum_model.keras3.torch_training import replicas_in_sync
    from accum_model.keras3.torch_training import (
        stateless_accumulate_gradients)
else:
    from accum_model.keras3.tensorflow_normalization import (
        recording_batch_statistics)
    from accum_model.keras3.tensorflow_optimizer import LossScaling
    from accum_model.keras3.tensorflow_saving import WindowCheckpoint
    from accum_model.keras3.tensorflow_training import END_OF_DATA_ERRORS
    from accum_model.keras3.tensorflow_training import (
        STEPS_PER_EXECUTION_FIX)
    from accum_model.keras3.tensorflow_training import Accumulation
    from accum_model.keras3.tensorflow_training import ModelDifferences
    from accum_model.keras3.tensorflow_training import accumulate_gradients
    from accum_model.keras3.tensorflow_training import (
        accumulating_train_step)
    from accum_model.keras3.tensorflow_training import batch_split_ways
    from accum_model.keras3.tensorflow_training import check_strategy
    from accum_model.keras3.tensorflow_training import (
        default_micro_batch_weight)
    from accum_model.keras3.tensorflow_training import (
        executions_stop_cleanly_at_end_of_data)
    from accum_model.keras3.tensorflow_training import (
        foreign_variables_in_graph)
    from accum_model.keras3.tensorflow_training import is_foreign_layer
    from accum_model.keras3.tensorflow_training import logs_for_reduction
    from accum_model.keras3.tensorflow_training import replicas_in_sync
    from accum_model.keras3.tensorflow_training import (
        stateless_accumulate_gradients)

__all__ = [
    "Accumulation",
    "BACKEND",
    "END_OF_DATA_ERRORS",
    "Functional",
    "LOSS_REDUCTIONS",
    "LossScaling",
    "ModelDifferences",
    "STEPS_PER_EXECUTION_FIX",
    "WindowCheckpoint",
    "accumulate_gradients",
    "accumulating_train_step",
    "batch_split_ways",
    "check_optimizer",
    "check_strategy",
    "clones_through_constructor",
    "compute_loss",
    "default_micro_batch_weight",
    "executions_stop_cleanly_at_end_of_data",
    "float16_gradient_flags",
    "functional_constructor_signature",
    "foreign_variables_in_graph",
    "get_keras_mask",
    "is_foreign_layer",
    "keras",
    "layers_of",
    "learning_rate_of",
    "logged_loss_totals",
    "loss_logged_by_window",
    "logs_for_reduction",
    "losses_not_divided_by_replicas",
    "micro_steps_in_epoch",
    "model_keyword_arguments",
    "pools_moving_statistics",
    "recording_batch_statistics",
    "recording_loss_reductions",
    "register_plain_name",
    "replicas_in_sync",
    "scalable_learning_rate",
    "serialize_as",
    "stateless_accumulate_gradients",
    "steps_per_execution",
    "track_loss",
    "wrap_sequential_cloning",
]
