"""Every private Keras or TensorFlow detail accum_model relies on.

Checked against keras 3.15.1 and tensorflow 2.21.0. Each helper names the
private member it touches, so a Keras upgrade is one file to review.
"""

import tensorflow as tf
from keras import tree
from keras.src.backend.common.masking import get_keras_mask
from keras.src.models.functional import Functional
from keras.src.saving import object_registration

__all__ = [
    "Functional",
    "serialize_as",
    "get_keras_mask",
    "logs_for_reduction",
    "loss_tracker",
    "symbolic_build_from_local_batch",
    "strategy_supports_no_merge_call",
]


def loss_tracker(model):
    """Returns the `Mean` metric that `fit()` reports as "loss", or None.

    Keras keeps it in the private `Trainer._loss_tracker`; its own
    `train_step` updates it directly and no public accessor exists.
    """
    return getattr(model, "_loss_tracker", None)


def strategy_supports_no_merge_call():
    """Whether the current strategy may run its updates without `merge_call`.

    `tf.__internal__.distribute.strategy_supports_no_merge_call` is what
    Keras's own optimizers consult for the same decision.
    """
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


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
    for _, _, batches in iterator:
        batch = next(batches)
        break
    else:
        return

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    with strategy.scope():
        model._symbolic_build(data_batch=tree.map_structure(local, batch))


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
