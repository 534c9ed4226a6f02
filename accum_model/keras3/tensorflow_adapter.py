"""Keras 3's training loop on TensorFlow, as a window needs it.

Each helper names the private member it touches, so a Keras upgrade is one
file to review. Where Keras 3 versions differ, the helper detects what the
running Keras offers rather than reading its version.

Checked (the tests that exercise each helper pass, `.ci/matrix`) on:

| helper | keras 3.6.0 / TF 2.16.2 | 3.10.0 / TF 2.18.1 | 3.15.1 / TF 2.21.0 |
|---|---|---|---|
| `TensorFlowModelDifferences` (`_maybe_symbolic_build`; epoch iterator of 2 or 3 items, or `enumerate_epoch`) | yes | yes | yes |
| `executions_stop_cleanly_at_end_of_data` | no (refused) | yes | yes |
| `logs_for_reduction` | yes | yes | yes |
| `layers_of` (`Layer._flatten_layers`), `is_foreign_layer` | yes | yes | yes |
| `model_keyword_arguments` | yes | yes | yes |
"""


import keras
import tensorflow as tf
from keras import tree
from keras.src.models.functional import Functional

from accum_model.core import class_tree
from accum_model.keras3 import losses
from accum_model.keras3 import tensorflow_normalization as normalization
from accum_model.keras3.adapter import Keras3Adapter
from accum_model.keras3.tensorflow_optimizer import TensorFlowLossScaling
from accum_model.keras3.saving import InKerasFiles
from accum_model.tensorflow import train_step as tf_step
from accum_model.tensorflow.accumulation import TensorFlowAccumulation
from accum_model.tensorflow.checkpoint import TensorFlowWindowCheckpoint
from accum_model.tensorflow.ops import TF_SHAPES


class TensorFlowModelDifferences:
    """What the Keras 3 `AccumulatingModel` does on TensorFlow."""

    def make_train_function(self, force=False):
        if self._accumulation.accumulates and (force
                                               or self.train_function is None):
            build_window_before_tracing(self)
        return super().make_train_function(force)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # A private Keras hook; see `symbolic_build_from_local_batch`.
        distributed = getattr(self, "_distribute_strategy", None) is not None
        if (not self._accumulation.accumulates or not distributed
                or iterator is None):
            return super()._maybe_symbolic_build(iterator, data_batch)
        symbolic_build_from_local_batch(self, iterator)


def build_window_before_tracing(model):
    """Builds the window's variables eagerly, before the step is traced.

    A `tf.function` whose first trace creates variables is traced twice;
    for a large model that doubles the first `fit()`'s tracing. A built
    functional model has all its weights, so the optimizer (if Keras has
    not built it yet) and the window are built for them and for the
    normalization calls the built-in step is expected to make; the traced
    step builds the window anew in the rare case that it finds other calls
    (a layer called twice).
    """
    accumulation = model._accumulation
    base = class_tree.accumulating_base(type(model))
    # A functional model has every weight once built; another (a subclass)
    # may create some in its first training call, which must come before
    # the optimizer is built: the traced step builds both then.
    if (accumulation.window is not None or not model.built
            or not isinstance(model, Functional)
            or type(model).train_step is not base.train_step):
        return
    variables = list(model.trainable_variables)
    if not variables:
        return
    accumulation.ensure_state(
        variables, model.distribute_strategy,
        normalization.expected_statistics_calls(class_tree.layers_of(model)))


def symbolic_build_from_local_batch(model, iterator):
    """Builds model, compiled loss and metrics from the first local batch.

    Replaces `TensorFlowTrainer._maybe_symbolic_build`, which reduces the
    first distributed batch across replicas with `strategy.reduce`. Under
    MultiWorkerMirroredStrategy with two workers that raises "Attempt to
    convert a value (PerReplica...)" before training starts (plain
    `keras.Model` too), and under MirroredStrategy it fails when the first
    batch splits unevenly. Only shapes matter here, so the first replica's
    local batch serves. Calls the private `Trainer._symbolic_build`.
    """
    strategy = model.distribute_strategy
    for step in _epoch_steps(iterator):
        # The data iterator comes last: (begin, end, iterator) in keras
        # 3.11+, (step, iterator) before.
        spec = step[-1].element_spec
        break
    else:
        return

    def local(value):
        specs = getattr(value, "_value_specs", None)
        return value if specs is None else specs[0]

    with strategy.scope():
        model._symbolic_build(data_batch=tree.map_structure(local, spec))


def _epoch_steps(epoch_iterator):
    """Steps of a Keras `EpochIterator`: iterable from keras 3.8 on, through
    `enumerate_epoch()` before."""
    if hasattr(epoch_iterator, "__iter__"):
        return iter(epoch_iterator)
    return epoch_iterator.enumerate_epoch()


class Keras3TensorFlowWindowCheckpoint(InKerasFiles,
                                       TensorFlowWindowCheckpoint):
    """The open window in Keras files and in TensorFlow checkpoints
    (`tensorflow.checkpoint`). Checked on keras 3.6.0 / TF 2.16.2, 3.10.0 /
    TF 2.18.1 and 3.15.1 / TF 2.21.0."""


class TensorFlowAdapter(tf_step.TensorFlowSteps, Keras3Adapter):
    """Keras 3 on TensorFlow: the window of `accum_model.tensorflow`."""

    # Measured on keras 3.6.0 and 3.15.1 (tests/test_large_batch_check.py).
    SPARSE_ROW_STRAYS = frozenset({"optimizer", "clipping"})

    Accumulation = TensorFlowAccumulation
    LossScaling = TensorFlowLossScaling
    ModelDifferences = TensorFlowModelDifferences
    WindowCheckpoint = Keras3TensorFlowWindowCheckpoint
    END_OF_DATA_ERRORS = (StopIteration,)
    STEPS_PER_EXECUTION_FIX = (
        f"With keras {keras.__version__}, `steps_per_execution > 1` can run "
        "part of a training step when the data runs out inside an "
        "execution, which would leave a window half updated. Compile with "
        "steps_per_execution=1, or upgrade: pip install 'keras>=3.8'")

    recording_batch_statistics = staticmethod(
        normalization.recording_batch_statistics)

    @staticmethod
    def executions_stop_cleanly_at_end_of_data():
        """Whether `steps_per_execution > 1` ends an epoch between steps.

        From keras 3.8 on (checked on 3.10 and 3.15) the TensorFlow
        trainer builds its train function in
        `TensorFlowTrainer._make_function`, whose loop asks
        `get_next_as_optional` before each step. keras 3.6's runs
        `next(iterator)` steps in one `tf.function`, and when the data runs
        out inside an execution part of a step's updates may already have
        run.
        """
        from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

        return hasattr(TensorFlowTrainer, "_make_function")

    @staticmethod
    def logs_for_reduction(logs, strategy):
        """Shapes `train_step` logs so that Keras can reduce them over
        workers.

        Under MultiWorkerMirroredStrategy in multi-worker mode, Keras's
        `reduce_per_replica` averages each log with
        `strategy.reduce("MEAN", value, axis=0)`, which raises "Invalid
        reduction dimension 0 for input with 0 dimensions" on the scalar
        logs every `train_step` returns. Giving scalars one axis of length
        1 makes that reduction the mean over replicas, a scalar again.
        """
        multi_worker = isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy
        ) and strategy.extended._in_multi_worker_mode()
        if not multi_worker:
            return logs
        return {
            name: tf.reshape(value, [1]) if value.shape.rank == 0 else value
            for name, value in logs.items()
        }

    @staticmethod
    def is_foreign_layer(value):
        """Whether `value` is a Keras 2 layer, whose weights Keras 3 does
        not see.

        Keras 2 (`tf_keras`, or TensorFlow 2.15's own) layers are
        `tf.Module`s, and Keras 3 layers are not; Keras 3 tracks neither
        their weights nor their sub-layers.
        """
        return (isinstance(value, tf.Module)
                and hasattr(value, "trainable_weights")
                and not isinstance(value, keras.layers.Layer))

    @staticmethod
    def recording_loss_reductions(reduced=None):
        return losses.recording_loss_reductions(TF_SHAPES, reduced)

    @staticmethod
    def check_strategy(model):
        """Refuses strategies whose variables live off-replica."""
        tf_step.check_strategy(model.distribute_strategy)
