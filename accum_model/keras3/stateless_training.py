"""What Keras 3's JAX and PyTorch trainers share, as a window needs it.

Both loops learn that data ran out before a step (no step raises, none
runs on an empty batch), run on one replica as far as a window can tell
(JAX's `keras.distribution` runs one program over the sharded batch), hold
no Keras 2 layer, and record BatchNormalization's moments through
`stateless_normalization`. Checked on keras 3.10.0 and 3.15.1 with jax
0.10.2, and keras 3.15.1 with torch 2.13.0.
"""

import contextlib

from accum_model.core import class_tree
from accum_model.core import divisor
from accum_model.keras3 import losses
from accum_model.keras3.stateless_ops import KERAS_SHAPES

# What the adapter offers from here (through each backend's module);
# `has_default_micro_batch_weight` is for those modules alone.
__all__ = ["END_OF_DATA_ERRORS", "STEPS_PER_EXECUTION_FIX",
           "default_micro_batch_weight",
           "executions_stop_cleanly_at_end_of_data",
           "foreign_variables_in_graph", "is_foreign_layer",
           "logs_for_reduction", "recording_batch_statistics",
           "replicas_in_sync"]

# The loop stops before a step when the data runs out: no step raises.
END_OF_DATA_ERRORS = ()

# Executions stop cleanly (JAX), or Keras refuses more than one step per
# execution itself (PyTorch): nothing to fix.
STEPS_PER_EXECUTION_FIX = ""


def executions_stop_cleanly_at_end_of_data():
    """The loop runs an execution's steps one by one and stops between two
    when the data runs out."""
    return True


def replicas_in_sync(model):
    del model
    return 1


def default_micro_batch_weight(model, x, y_pred):
    """What Keras divided this micro step's loss by (inside the step)."""
    return divisor.default_weight(model, x, y_pred, losses.get_keras_mask,
                                  KERAS_SHAPES)


def foreign_variables_in_graph(model):
    del model
    return []


def is_foreign_layer(value):
    """No Keras 2 layer can sit in a model here (Keras 2 is TensorFlow's)."""
    del value
    return False


def logs_for_reduction(logs, strategy):
    del strategy
    return logs


@contextlib.contextmanager
def recording_batch_statistics(layers):
    """Unused: the step records through `PooledStatistics`."""
    del layers
    yield []


def has_default_micro_batch_weight(model_class):
    """Whether `model_class` keeps the built-in `micro_batch_weight`."""
    base = class_tree.accumulating_base(model_class)
    return model_class.micro_batch_weight is base.micro_batch_weight
