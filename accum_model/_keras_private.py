"""The Keras 3 adapter: every private Keras 3 detail accum_model relies on.

Offers the names `_keras2_private` offers for Keras 2 (see `_adapter`).
Each helper names the private member it touches, so a Keras upgrade is one
file to review. Where Keras 3 versions differ, the helper detects what the
running Keras offers rather than reading its version.

Checked (the tests that exercise each helper pass, `.ci/matrix`) on:

| helper | keras 3.6.0 / TF 2.16.2 | 3.10.0 / TF 2.18.1 | 3.15.1 / TF 2.21.0 |
|---|---|---|---|
| `Functional`, `functional_like_constructor`, `serialize_as` | yes | yes | yes |
| `get_keras_mask` | yes | yes | yes |
| `losses_not_divided_by_replicas` (absent before 3.8: nothing to undo) | yes | yes | yes |
| `recording_loss_reductions`, `merged_sample_weight` | yes | yes | yes |
| `track_loss` (`Trainer._loss_tracker`) | yes | yes | yes |
| `ModelDifferences` (`_maybe_symbolic_build`; epoch iterator of 2 or 3 items, or `enumerate_epoch`) | yes | yes | yes |
| `executions_stop_cleanly_at_end_of_data` | no (refused) | yes | yes |
| `logs_for_reduction` | yes | yes | yes |
| `layers_of` (`Layer._flatten_layers`), `is_foreign_layer` | yes | yes | yes |
| `SavedWithModel` (`KerasSaveable`, `saving_lib` walk; TF `Trackable`) | yes | yes | yes |
"""

import contextlib
import inspect
import math

import keras
import tensorflow as tf
from keras import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.models.functional import Functional
from keras.src.models.functional import functional_like_constructor
from keras.src.losses import loss as keras_loss_module
from keras.src.saving import object_registration
from keras.src.saving.keras_saveable import KerasSaveable

from accum_model._class_tree import next_init_class
from accum_model._class_tree import next_init_is_keras_model
from accum_model._loss_scaling import LossScaling
from accum_model._tf_checkpoint import SavedInTfCheckpoints

__all__ = [
    "Functional",
    "LossScaling",
    "ModelDifferences",
    "compute_loss",
    "executions_stop_cleanly_at_end_of_data",
    "losses_not_divided_by_replicas",
    "merged_sample_weight",
    "recording_loss_reductions",
    "clones_through_constructor",
    "model_keyword_arguments",
    "is_foreign_layer",
    "layers_of",
    "serialize_as",
    "get_keras_mask",
    "logs_for_reduction",
    "steps_per_execution",
    "track_loss",
    "symbolic_build_from_local_batch",
    "SavedWithModel",
]

# Reductions whose batch loss is one number a window can reproduce.
LOSS_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight",
                   "sum")

# What a run of the train function raises when the data has run out.
END_OF_DATA_ERRORS = (StopIteration,)

STEPS_PER_EXECUTION_FIX = (
    f"With keras {keras.__version__}, `steps_per_execution > 1` can run part "
    "of a training step when the data runs out inside an execution, which "
    "would leave a window half updated. Compile with steps_per_execution=1, "
    "or upgrade: pip install 'keras>=3.8'"
)


class ModelDifferences:
    """What the Keras 3 `AccumulatingModel` does unlike the Keras 2 one."""

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        # A private Keras hook; see `symbolic_build_from_local_batch`.
        distributed = getattr(self, "_distribute_strategy", None) is not None
        if (not self._window_policy.accumulates or not distributed
                or iterator is None):
            return super()._maybe_symbolic_build(iterator, data_batch)
        symbolic_build_from_local_batch(self, iterator)


def check_strategy(strategy):
    """Every strategy `_checks.check_strategy` admits runs on Keras 3."""
    del strategy


def steps_per_execution(model):
    return int(getattr(model, "steps_per_execution", 1) or 1)


def micro_steps_in_epoch(steps, steps_per_execution):
    """Steps an epoch of `steps` runs: Keras 3 runs whole executions, so up
    to the next multiple of `steps_per_execution`."""
    return math.ceil(steps / steps_per_execution) * steps_per_execution


def functional_constructor_signature():
    """None: Keras 3's `clone_model` accepts a constructor taking
    `*args, **kwargs` as functional-like."""
    return None


def track_loss(model, loss, batch_size):
    """Adds a micro-batch's loss to the "loss" that `fit()` reports.

    Keras keeps that `Mean` metric in the private `Trainer._loss_tracker`;
    its own `train_step` updates it directly, weighted by the batch size,
    and no public accessor exists.
    """
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is not None:
        tracker.update_state(loss, sample_weight=batch_size)


def serialize_as(alias_class, registered_class):
    """Makes Keras serialize `alias_class` under `registered_class`'s name.

    `keras.saving.get_registered_name` reads the private
    `GLOBAL_CUSTOM_NAMES`; the name still resolves to `registered_class` when
    loading, because `GLOBAL_CUSTOM_OBJECTS` is left as it is.
    """
    names = object_registration.GLOBAL_CUSTOM_NAMES
    if registered_class in names:
        names[alias_class] = names[registered_class]


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
        batch = next(step[-1])
        break
    else:
        return

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    with strategy.scope():
        model._symbolic_build(data_batch=tree.map_structure(local, batch))


def _epoch_steps(epoch_iterator):
    """Steps of a Keras `EpochIterator`: iterable from keras 3.8 on, through
    `enumerate_epoch()` before."""
    if hasattr(epoch_iterator, "__iter__"):
        return iter(epoch_iterator)
    return epoch_iterator.enumerate_epoch()


def logs_for_reduction(logs, strategy):
    """Shapes `train_step` logs so that Keras can reduce them over workers.

    Under MultiWorkerMirroredStrategy in multi-worker mode, Keras's
    `reduce_per_replica` averages each log with
    `strategy.reduce("MEAN", value, axis=0)`, which raises "Invalid reduction
    dimension 0 for input with 0 dimensions" on the scalar logs every
    `train_step` returns. Giving scalars one axis of length 1 makes that
    reduction the mean over replicas, a scalar again.
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


def compute_loss(model, **arguments):
    """Calls `model.compute_loss` with `training=True` where it takes it.

    Keras's `Trainer._compute_loss` makes that choice for overrides of
    `compute_loss` written before Keras 3.3, which lack `training`.
    """
    if "training" in inspect.signature(model.compute_loss).parameters:
        return model.compute_loss(training=True, **arguments)
    return model.compute_loss(**arguments)


def model_keyword_arguments(functional):
    """Keyword arguments Keras's model constructor accepts.

    `Layer.__init__` names its keywords and also pops `input_dim` and
    `input_shape` from `**kwargs` (keras 3.15.1); `Functional.__init__` adds
    `inputs`, `outputs` and passes on only `name` and `trainable`.
    """
    names = {
        name
        for name, parameter in inspect.signature(
            keras.layers.Layer.__init__
        ).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    } | {"name", "input_dim", "input_shape"}
    if functional:
        names |= set(inspect.signature(Functional.__init__).parameters)
        names.discard("self")
        names.discard("kwargs")
    return names


def clones_through_constructor(model_class):
    """Whether `keras.models.clone_model` rebuilds via `model_class(...)`.

    Keras's `functional_like_constructor` decides from the constructor's
    signature; AccumulatingModel's own signature passes every argument on,
    so the class after it in the MRO is the one that must accept them.
    """
    if next_init_is_keras_model(model_class):
        return True
    return functional_like_constructor(next_init_class(model_class))


def layers_of(model):
    """The model and every layer in it (private `Layer._flatten_layers`)."""
    return [model] + list(model._flatten_layers(include_self=False))


def is_foreign_layer(value):
    """Whether `value` is a Keras 2 layer, whose weights Keras 3 does not see.

    Keras 2 (`tf_keras`, or TensorFlow 2.15's own) layers are `tf.Module`s,
    and Keras 3 layers are not; Keras 3 tracks neither their weights nor
    their sub-layers.
    """
    return (isinstance(value, tf.Module)
            and hasattr(value, "trainable_weights")
            and not isinstance(value, keras.layers.Layer))


@contextlib.contextmanager
def losses_not_divided_by_replicas():
    """While tracing a loss, keeps Keras from dividing it by the replicas.

    Keras 3.8+ divides each reduced loss by the number of replicas in
    `keras.src.losses.loss.scale_loss_for_distribution`, but not a loss that
    is already a scalar before reduction (an output of shape `(batch,)`, a
    `Loss` whose `call` returns the batch mean), and Keras 3.6-3.7 divide
    none. Made the identity here (with its inverse, which per-output loss
    metrics use), every loss is this replica's own mean, whatever the Keras
    version or loss shape. Checked on keras 3.15.1.
    """
    names = ("scale_loss_for_distribution", "unscale_loss_for_distribution")
    saved = {n: getattr(keras_loss_module, n, None) for n in names}
    for name, function in saved.items():
        if function is not None:
            setattr(keras_loss_module, name, _identity)
    try:
        yield
    finally:
        for name, function in saved.items():
            if function is not None:
                setattr(keras_loss_module, name, function)


def _identity(value):
    return value


@contextlib.contextmanager
def recording_loss_reductions():
    """Records how Keras reduces each loss computed inside the context.

    Wraps `keras.src.losses.loss.reduce_weighted_values`, the one place
    where a `keras.losses.Loss` (built-in, subclassed, or a plain function
    Keras wraps) reduces its per-element values, with the mask made by the
    loss itself (`ignore_class`) already merged with the prediction's. The
    returned list receives one `_loss_divisor.Reduction` per loss term.
    Checked on keras 3.15.1.
    """
    from accum_model import _loss_divisor

    records = []
    original = keras_loss_module.reduce_weighted_values

    def recording(values, sample_weight=None, mask=None,
                  reduction="sum_over_batch_size", dtype=None):
        loss = original(values, sample_weight=sample_weight, mask=mask,
                        reduction=reduction, dtype=dtype)
        records.append(_loss_divisor.reduction_of(
            values, sample_weight, mask, reduction))
        return loss

    keras_loss_module.reduce_weighted_values = recording
    try:
        yield records
    finally:
        keras_loss_module.reduce_weighted_values = original


def merged_sample_weight(values, sample_weight, mask, reduction):
    """Sample weights with the mask merged in, as Keras divides by them.

    Uses Keras's own `apply_mask` and `squeeze_or_expand_to_same_rank`
    (keras.src.losses.loss), so "mean_with_sample_weight" divides by what
    Keras divides by.
    """
    values = tf.convert_to_tensor(values)
    weights = keras_loss_module.apply_mask(
        sample_weight, mask, dtype=values.dtype, reduction=reduction
    )
    if weights is None:
        return tf.ones_like(values)
    weights = tf.cast(weights, values.dtype)
    _, weights = keras_loss_module.squeeze_or_expand_to_same_rank(
        values, weights
    )
    return tf.cast(weights, tf.float32)


def executions_stop_cleanly_at_end_of_data():
    """Whether `steps_per_execution > 1` ends an epoch between steps.

    From keras 3.8 on (checked on 3.10 and 3.15) the TensorFlow trainer
    builds its train function in `TensorFlowTrainer._make_function`, whose
    loop asks `get_next_as_optional` before each step. keras 3.6's runs
    `next(iterator)` steps in one `tf.function`, and when the data runs out
    inside an execution part of a step's updates may already have run.
    """
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return hasattr(TensorFlowTrainer, "_make_function")


class SavedWithModel(KerasSaveable, SavedInTfCheckpoints):
    """Base of a model attribute whose state every checkpoint carries.

    Keras files (`save_weights`, `.keras`, `ModelCheckpoint`,
    `BackupAndRestore`): `saving_lib._walk_saveable` visits every attribute
    of the model that is a `KerasSaveable`, private ones last, and calls its
    `save_own_variables` / `load_own_variables` with an entry of its own;
    a file without that entry gives an empty one, and a model without the
    attribute never asks for it (a plain `keras.Model` loads such a file).
    TensorFlow checkpoints: see `SavedInTfCheckpoints`.

    Subclasses implement `has_state()`, `saved_state()` (a dict of arrays,
    always with the same keys) and `restore_state(arrays)`. Keras files
    store nothing while `has_state()` is false, so they stay what a plain
    model would write.
    """

    def _obj_type(self):
        # Which of Keras's attribute skip-sets applies when the saver walks
        # this object; it holds no Keras objects of its own.
        return "Layer"

    def save_own_variables(self, store):
        if self.has_state():
            for key, value in self.saved_state().items():
                store[key] = value

    def load_own_variables(self, store):
        self.restore_state({key: store[key] for key in store.keys()})
