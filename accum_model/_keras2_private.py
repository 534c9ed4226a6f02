"""The Keras 2 adapter: every Keras 2 detail accum_model relies on.

Offers the names `_keras_private` offers for Keras 3, so that the model
class, the window and the checks are written once. Keras 2 is
`tf_keras` (with `TF_USE_LEGACY_KERAS=1`) or TensorFlow 2.13-2.15's own
`keras`; both keep their code under `<package>.src`.

Where Keras 2 differs from Keras 3:

* loss and divisor: `compile_utils.LossesContainer` divides each loss by
  the replicas (`losses_utils.scale_loss_for_distribution`), and
  `losses.Loss.__call__` divides a masked loss by its valid elements
  (`losses_utils.apply_valid_mask`, then `compute_weighted_loss`);
* optimizer: `apply_gradients(pairs)` sums the gradients over replicas
  *before* clipping them, so the window needs no reduction of its own for
  clipping to act on the whole gradient;
* loss scaling: `LossScaleOptimizer.get_scaled_loss` /
  `get_unscaled_gradients` are the hooks, and the dynamic scale lives in a
  private `_DynamicLossScaleState` whose own `update` rule is reused;
* checkpoints: only TensorFlow checkpoints (`save_weights` in the TF
  format, `tf.train.Checkpoint`, `BackupAndRestore`) carry the window;
  Keras 2's `model.save` files (`.keras`, `.h5`, SavedModel) and `.h5`
  weights cannot, and saving one with a window open warns;
* the training loop ends data with `tf.errors.OutOfRangeError`, keeps
  `steps_per_execution` in a variable and shortens an epoch's last
  execution to the steps left.

Checked (the Keras 2 tests, `tests/test_keras2.py`, in `.ci/matrix`) on
tf_keras 2.21.0 / TF 2.21.0 with `TF_USE_LEGACY_KERAS=1`, and on keras
2.15.0 / TF 2.15.1 and keras 2.13.1 / TF 2.13.1.
"""

import contextlib
import importlib
import sys
import warnings

import tensorflow as tf

from accum_model import _class_tree
from accum_model._loss_scaling import OptimizerDuties
from accum_model._tf_checkpoint import SavedInTfCheckpoints

# The package behind `tf.keras`, as TensorFlow chose it: tf_keras (with
# TF_USE_LEGACY_KERAS=1) or, on TensorFlow 2.13-2.15, keras.
keras = importlib.import_module(tf.keras.Model.__module__.split(".")[0])


def _src(module):
    return importlib.import_module(f"{keras.__name__}.src.{module}")


_losses_utils = _src("utils.losses_utils")
_functional = _src("engine.functional")
_object_registration = _src("saving.object_registration")
_optimizer_v2 = _src("optimizers.legacy.optimizer_v2")

Functional = _functional.Functional

# Reductions whose batch loss is one number a window can reproduce.
LOSS_REDUCTIONS = ("auto", "sum_over_batch_size", "sum")

# What a run of the train function raises when the data has run out.
END_OF_DATA_ERRORS = (StopIteration, tf.errors.OutOfRangeError)

STEPS_PER_EXECUTION_FIX = ""  # Keras 2 executions stop between steps.


class ModelDifferences:
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


def _warn_if_window_is_left_out(model, kind):
    open_steps = model._open_micro_steps()
    if open_steps:
        warnings.warn(
            f"{open_steps} micro-batches are accumulated and not yet "
            f"applied, and {kind} cannot hold them: a model loaded from it "
            "starts a new window. Save in the TensorFlow format "
            "(`save_weights('path/ckpt')`, `tf.train.Checkpoint`, "
            "`BackupAndRestore`), which keeps the window, or call "
            "`model.apply_open_window()` before saving.",
            stacklevel=3,
        )


class LossScaling(OptimizerDuties):
    """The compiled Keras 2 optimizer's duties: loss scaling and apply.

    Each micro step scales its loss with the `LossScaleOptimizer`'s own
    `get_scaled_loss` and unscales its gradients with its own
    `get_unscaled_gradients`; the window end applies the unscaled window
    gradient with the inner optimizer and moves the dynamic scale by
    Keras's own rule, once per window.

    Args:
        optimizer: The compiled optimizer, a `LossScaleOptimizer` or not.
    """

    # Keras 2 optimizers sum gradients over replicas, then clip.
    clips_before_summing_replicas = False

    def __init__(self, optimizer):
        super().__init__(optimizer, keras.mixed_precision.LossScaleOptimizer)

    def scale_loss(self, loss):
        if not self.active:
            return loss
        return self.loss_scale_optimizer.get_scaled_loss(loss)

    def unscale_gradients(self, gradients, variables=None):
        del variables  # Keras 2 has no variables it overwrites with gradients.
        if not self.active:
            return gradients
        return self.loss_scale_optimizer.get_unscaled_gradients(gradients)

    def _dynamic_state(self):
        lso = self.loss_scale_optimizer
        if lso is None or not lso.dynamic:
            return None
        # Private: `_DynamicLossScaleState`, with Keras's update rule.
        return lso._loss_scale

    def after_update(self):
        """Counts one applied update; doubles the scale every growth period."""
        state = self._dynamic_state()
        if state is not None:
            state.update([tf.constant(1.0)])

    def after_overflow(self):
        """Halves the scale (not below 1) and restarts the growth period."""
        state = self._dynamic_state()
        if state is not None:
            state.update([tf.constant(float("inf"))])

    def is_built(self):
        optimizer = self.update_optimizer
        if isinstance(optimizer, _optimizer_v2.OptimizerV2):
            return False  # Legacy optimizers make slots on demand.
        return bool(getattr(optimizer, "_built", False))

    def build(self, variables):
        optimizer = self.update_optimizer
        if isinstance(optimizer, _optimizer_v2.OptimizerV2):
            optimizer._create_all_weights(variables)
        else:
            optimizer.build(variables)

    def apply(self, gradients, variables):
        self.update_optimizer.apply_gradients(zip(gradients, variables))


def check_strategy(strategy):
    """Refuses the strategies the Keras 2 adapter was not checked under."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        raise ValueError(
            "AccumulatingModel on Keras 2 supports the default strategy, "
            "OneDeviceStrategy and MirroredStrategy; several workers "
            "(MultiWorkerMirroredStrategy) need Keras 3: unset "
            "TF_USE_LEGACY_KERAS, or pip install 'keras>=3.6' "
            "'tensorflow>=2.16'. Received: distribute_strategy="
            f"{strategy.__class__.__name__}"
        )


def compute_loss(model, **arguments):
    return model.compute_loss(**arguments)


def steps_per_execution(model):
    """Int. Keras 2 keeps it in the private `_steps_per_execution`."""
    variable = getattr(model, "_steps_per_execution", None)
    return 1 if variable is None else int(variable.numpy())


def executions_stop_cleanly_at_end_of_data():
    """True: Keras 2's train function of several steps loops
    `for _ in tf.range(steps_per_execution)` over whole steps, each asking
    the iterator for its data before anything else of it runs."""
    return True


def micro_steps_in_epoch(steps, steps_per_execution):
    """Steps an epoch of `steps` runs: Keras 2's `DataHandler` shortens the
    epoch's last execution to the steps left."""
    del steps_per_execution
    return steps


def get_keras_mask(tensor):
    return getattr(tensor, "_keras_mask", None)


def track_loss(model, loss, batch_size):
    """Nothing to do: Keras 2's compiled loss updates the "loss" it reports."""
    del model, loss, batch_size


def logs_for_reduction(logs, strategy):
    del strategy
    return logs


@contextlib.contextmanager
def losses_not_divided_by_replicas():
    """While tracing a loss, keeps Keras 2 from dividing it by the replicas.

    `LossesContainer.__call__` divides each mean loss, and the sum of the
    regularization losses, by the number of replicas through
    `losses_utils.scale_loss_for_distribution`; made the identity, every
    loss is this replica's own mean.
    """
    original = _losses_utils.scale_loss_for_distribution
    _losses_utils.scale_loss_for_distribution = _identity
    try:
        yield
    finally:
        _losses_utils.scale_loss_for_distribution = original


def _identity(value):
    return value


@contextlib.contextmanager
def recording_loss_reductions():
    """Records how Keras 2 reduces each loss computed inside the context.

    `losses.Loss.__call__` merges the prediction's mask with the loss's,
    hands it to `losses_utils.apply_valid_mask` (which reweights the valid
    elements so that the mean divides by their number) and reduces with
    `losses_utils.compute_weighted_loss`. Both are wrapped; the returned
    list receives one `_loss_divisor.Reduction` per loss term.
    """
    records = []
    masks = []
    apply_valid_mask = _losses_utils.apply_valid_mask
    compute_weighted_loss = _losses_utils.compute_weighted_loss

    def noting_mask(losses, sample_weight, mask, reduction):
        masks.append(mask)
        return apply_valid_mask(losses, sample_weight, mask, reduction)

    def recording(losses, sample_weight=None, reduction="sum_over_batch_size",
                  name=None):
        loss = compute_weighted_loss(losses, sample_weight,
                                     reduction=reduction, name=name)
        mask = masks.pop() if masks else None
        records.append(_reduction_of(losses, mask, reduction))
        return loss

    _losses_utils.apply_valid_mask = noting_mask
    _losses_utils.compute_weighted_loss = recording
    try:
        yield records
    finally:
        _losses_utils.apply_valid_mask = apply_valid_mask
        _losses_utils.compute_weighted_loss = compute_weighted_loss


def _reduction_of(losses, mask, reduction):
    from accum_model import _loss_divisor

    losses = tf.convert_to_tensor(losses)
    if reduction in (None, "none") or losses.shape.rank == 0:
        return _loss_divisor.Reduction(reduction, None, may_vary=True)
    if reduction == _loss_divisor.SUM:
        return _loss_divisor.Reduction(reduction, None, may_vary=False)
    if mask is not None:
        valid = tf.reduce_sum(tf.cast(mask, tf.float32))
        return _loss_divisor.Reduction("sum_over_batch_size", valid,
                                       may_vary=True)
    count = tf.cast(tf.size(losses), tf.float32)
    unknown_length = any(d is None for d in losses.shape[1:])
    return _loss_divisor.Reduction("sum_over_batch_size", count,
                                   may_vary=unknown_length)


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


def clones_through_constructor(model_class):
    """Whether `clone_model` may rebuild a model of `model_class` through a
    constructor whose signature is `Functional.__init__`'s (Keras 2's
    `has_functional_like_constructor` asks for exactly that signature)."""
    return _class_tree.next_init_is_keras_model(model_class)


def functional_constructor_signature():
    """The signature `clone_model` looks for in a functional class."""
    import inspect

    return inspect.signature(Functional.__init__)


def serialize_as(alias_class, registered_class):
    """Makes Keras 2 serialize `alias_class` under `registered_class`'s name.

    `get_registered_name` reads the private `_GLOBAL_CUSTOM_NAMES`.
    """
    names = _object_registration._GLOBAL_CUSTOM_NAMES
    if registered_class in names:
        names[alias_class] = names[registered_class]


def layers_of(model):
    """The model and every layer in it (private `Layer._flatten_layers`)."""
    return [model] + list(model._flatten_layers(include_self=False))


def is_foreign_layer(value):
    """Whether `value` is a Keras 3 layer, whose weights Keras 2 does not see.

    With `TF_USE_LEGACY_KERAS=1`, `import keras` is still Keras 3.
    """
    other = sys.modules.get("keras")
    other_layer = getattr(getattr(other, "layers", None), "Layer", None)
    if other is keras or other_layer is None or (
        other_layer is keras.layers.Layer
    ):
        return False
    return isinstance(value, other_layer)


class SavedWithModel(SavedInTfCheckpoints):
    """Base of a model attribute whose state TF checkpoints carry.

    Keras 2 tracks a `Trackable` attribute of a model as a checkpoint
    dependency, so `save_weights` in the TensorFlow format,
    `tf.train.Checkpoint` and `BackupAndRestore` save and restore it
    (see `SavedInTfCheckpoints`). Keras 2's `.keras` and `.h5` files hold
    only Keras objects (`saving_lib._is_keras_trackable`), and a SavedModel
    loaded by `load_model` is rebuilt from its config without it.
    """
