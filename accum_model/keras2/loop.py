"""Keras 2's training loop, as a window needs it.

The training loop ends data with `tf.errors.OutOfRangeError`, keeps
`steps_per_execution` in a variable and shortens an epoch's last execution
to the steps left. Checked on tf_keras 2.21.0 / TF 2.21.0 with
`TF_USE_LEGACY_KERAS=1`, keras 2.15.0 / TF 2.15.1 and keras 2.13.1 /
TF 2.13.1 (the Keras 2 tests, `tests/test_keras2.py`, in `.ci/matrix`).
"""

import sys
import warnings

import tensorflow as tf

from accum_model.core.class_tree import layers_of
from accum_model.core.messages import window_is_open
from accum_model.keras2.package import keras
from accum_model.tensorflow import train_step as tf_step
from accum_model.tensorflow.checkpoint import window_dtype_refusal


class Keras2ModelDifferences:
    """What the Keras 2 `AccumulatingModel` does unlike the Keras 3 one."""

    def save(self, filepath, *args, **kwargs):
        # `.keras`, `.h5` and SavedModel: Keras 2 loads none of them back
        # into a model with its window (SavedModel revives the model from
        # its config and leaves the window out).
        _warn_if_window_is_left_out(self, "a file of `model.save`")
        return super().save(filepath, *args, **kwargs)

    def save_weights(self, filepath, *args, **kwargs):
        if str(filepath).endswith((".h5", ".hdf5")):
            _warn_if_window_is_left_out(self, "an `.h5` weights file")
        return super().save_weights(filepath, *args, **kwargs)

    def load_weights(self, filepath, *args, **kwargs):
        # The open window becomes the file's, as Keras 3's files make it:
        # emptied first, then written where the file holds one (a
        # TensorFlow-format file), rather than kept from before the load.
        self._accumulation.checkpoint.empty()
        try:
            return super().load_weights(filepath, *args, **kwargs)
        except tf.errors.InvalidArgumentError as error:
            refusal = window_dtype_refusal(error)
            if refusal is None:
                raise
            raise refusal from error


def _warn_if_window_is_left_out(model, kind):
    open_steps = model._accumulation.open_micro_steps()
    if open_steps:
        warnings.warn(
            f"The model has {window_is_open(open_steps)}, or save in the "
            f"TensorFlow format: {kind} cannot hold the window, and a model "
            "loaded from it starts a new one. The TensorFlow format "
            "(`save_weights('path/ckpt')`, `tf.train.Checkpoint`, "
            "`BackupAndRestore`) keeps the window.",
            stacklevel=3,
        )


def check_strategy(model):
    """Refuses the strategies the Keras 2 adapter was not checked under."""
    strategy = model.distribute_strategy
    tf_step.check_strategy(strategy)
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        raise ValueError(
            "AccumulatingModel on Keras 2 supports the default strategy, "
            "OneDeviceStrategy and MirroredStrategy; several workers "
            "(MultiWorkerMirroredStrategy) need Keras 3: unset "
            "TF_USE_LEGACY_KERAS, or pip install 'keras>=3.6' "
            "'tensorflow>=2.16'. Received: distribute_strategy="
            f"{strategy.__class__.__name__}"
        )


def steps_per_execution(model):
    """Int. Keras 2 keeps it in the private `_steps_per_execution`."""
    variable = getattr(model, "_steps_per_execution", None)
    return 1 if variable is None else int(variable.numpy())


def micro_steps_in_epoch(steps, steps_per_execution):
    """Steps an epoch of `steps` runs: Keras 2's `DataHandler` shortens the
    epoch's last execution to the steps left."""
    del steps_per_execution
    return steps


def model_keyword_arguments(functional):
    """Keyword arguments Keras 2's model constructor accepts.

    `training.Model.__init__` validates its `**kwargs` against these names,
    and `Functional.__init__` takes `inputs`, `outputs`, `name`,
    `trainable`.
    """
    names = {"trainable", "dtype", "dynamic", "name", "autocast", "inputs",
             "outputs"}
    if functional:
        names = {"inputs", "outputs", "name", "trainable"}
    return names


def foreign_variables_in_graph(model):
    """Names of graph layers whose arguments hold a Keras 3 variable.

    A Keras 3 layer applied to a Keras 2 symbolic tensor becomes TensorFlow
    op layers (`tf.linalg.matmul`, `tf.nn.bias_add`, ...) whose node
    arguments (`Node.call_args`, `call_kwargs`) hold its variables (or
    constants made of them): Keras 2 trains none of them.
    """
    other = sys.modules.get("keras")
    variable_class = getattr(other, "Variable", None)
    if other is keras or variable_class is None:
        return []
    names = []
    for layer in layers_of(model):
        for node in getattr(layer, "inbound_nodes", []):
            values = tf.nest.flatten((node.call_args, node.call_kwargs))
            if any(isinstance(v, variable_class) for v in values):
                names.append(layer.name)
                break
    return names


def is_foreign_layer(value):
    """Whether `value` is a Keras 3 layer, whose weights Keras 2 does not see.

    With `TF_USE_LEGACY_KERAS=1`, `import keras` is still Keras 3; it is
    looked up among the modules already imported, never imported here.
    """
    other = sys.modules.get("keras")
    other_layer = getattr(getattr(other, "layers", None), "Layer", None)
    if other is keras or other_layer is None or (
        other_layer is keras.layers.Layer
    ):
        return False
    return isinstance(value, other_layer)
