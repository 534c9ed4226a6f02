"""The Keras 2 adapter: every Keras 2 detail accum_model relies on.

`accum_model.keras3` offers the same names (`__all__`) for Keras 3; the
model layer is written once against them and reaches this package only
through `accum_model._chooser`. `keras` is the package behind `tf.keras`:
`tf_keras` (with `TF_USE_LEGACY_KERAS=1`) or TensorFlow 2.13-2.15's own
`keras`. Each module says which Keras 2 versions it was checked on.
"""

from accum_model.keras2.package import keras
from accum_model.keras2.losses import LOSS_REDUCTIONS
from accum_model.keras2.losses import compute_loss
from accum_model.keras2.losses import get_keras_mask
from accum_model.keras2.losses import logged_loss_totals
from accum_model.keras2.losses import loss_logged_by_window
from accum_model.keras2.losses import losses_not_divided_by_replicas
from accum_model.keras2.losses import recording_loss_reductions
from accum_model.keras2.losses import track_loss
from accum_model.keras2.optimizer import LossScaling
from accum_model.keras2.normalization import pools_moving_statistics
from accum_model.keras2.normalization import recording_batch_statistics
from accum_model.keras2.optimizer import check_optimizer
from accum_model.keras2.optimizer import float16_gradient_flags
from accum_model.keras2.learning_rate import learning_rate_of
from accum_model.keras2.learning_rate import scalable_learning_rate
from accum_model.keras2.saving import Functional
from accum_model.keras2.saving import WindowCheckpoint
from accum_model.keras2.saving import clones_through_constructor
from accum_model.keras2.saving import functional_constructor_signature
from accum_model.keras2.saving import register_plain_name
from accum_model.keras2.saving import serialize_as
from accum_model.keras2.saving import wrap_sequential_cloning
from accum_model.keras2.training import BACKEND
from accum_model.keras2.training import END_OF_DATA_ERRORS
from accum_model.keras2.training import Accumulation
from accum_model.keras2.training import accumulate_gradients
from accum_model.keras2.training import accumulating_train_step
from accum_model.keras2.training import default_micro_batch_weight
from accum_model.keras2.training import replicas_in_sync
from accum_model.keras2.training import STEPS_PER_EXECUTION_FIX
from accum_model.keras2.training import ModelDifferences
from accum_model.keras2.training import check_strategy
from accum_model.keras2.training import batch_split_ways
from accum_model.keras2.training import executions_stop_cleanly_at_end_of_data
from accum_model.keras2.training import foreign_variables_in_graph
from accum_model.keras2.training import is_foreign_layer
from accum_model.keras2.training import layers_of
from accum_model.keras2.training import logs_for_reduction
from accum_model.keras2.training import micro_steps_in_epoch
from accum_model.keras2.training import model_keyword_arguments
from accum_model.keras2.training import stateless_accumulate_gradients
from accum_model.keras2.training import steps_per_execution

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
