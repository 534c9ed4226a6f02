"""Keras 3 on JAX: the window inside a pure training step.

Keras's JAX trainer (`keras/src/backend/jax/trainer.py`) jit-compiles a pure
`train_step(state, data)`, where `state` is the values of the trainable,
non-trainable, optimizer and metrics variables, and writes the values back
into the variables only at the end of an epoch (`jax_state_sync`). The
window's state (`WindowState`: accumulators and counters) rides in that
state behind the optimizer's variables: `ModelDifferences._get_jax_state`
appends it and `jax_state_sync` takes it back, so it is never a variable of
the model or of the optimizer (`get_weights()` and optimizer files stay what
plain Keras writes). Each micro step adds its gradient, times what Keras
divided its loss by, to the window; one `lax.cond` applies the window with
the optimizer's own `stateless_apply` when it is full or the epoch ends.
The numbers are `accum_model.core.arithmetic`'s and `divisor`'s.

Keras's JAX loop learns that data ran out before it runs a step, so no step
ever runs on an empty batch; the window still open at an epoch's end is
applied eagerly by the window callback, after Keras has written the state
back into the variables.

Not yet on JAX (each refused by name before training):
`keras.distribution`, float64 accumulators without `jax_enable_x64`, and
`accumulate_gradients` (a stateless step of the user's own).
BatchNormalization layers move their moving statistics per micro-batch
(`fit()` warns). The open
window is saved in Keras files, laid out as on TensorFlow.

Private Keras members used, checked on keras 3.15.1 with jax 0.10.2:
`_get_jax_state`, `jax_state_sync`, `_jax_state`, `_jax_state_synced`,
`stateless_call`, `stateless_compute_loss`, `_losses_override`,
`_call_has_training_arg`, `_loss_tracker`.
"""

import contextlib
import functools
import typing
import warnings
import weakref

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import optimizers
from keras.src.saving.keras_saveable import KerasSaveable

from accum_model.core import arithmetic
from accum_model.core import checkpoint_layout as layout
from accum_model.core import class_tree
from accum_model.core import divisor
from accum_model.core.messages import window_is_open
from accum_model.core.variables import is_overwritten_with_gradient
from accum_model.keras3 import losses
from accum_model.keras3.optimizer import float16_gradient_flags

__all__ = ["Accumulation", "END_OF_DATA_ERRORS", "LossScaling",
           "ModelDifferences", "STEPS_PER_EXECUTION_FIX", "WindowCheckpoint",
           "accumulate_gradients", "accumulating_train_step",
           "check_strategy", "default_micro_batch_weight",
           "executions_stop_cleanly_at_end_of_data",
           "foreign_variables_in_graph", "is_foreign_layer",
           "logs_for_reduction", "pools_moving_statistics",
           "recording_batch_statistics", "replicas_in_sync"]

JAX_OPS = arithmetic.ArrayOps(
    where=jnp.where, minimum=jnp.minimum, maximum=jnp.maximum,
    zeros_like=jnp.zeros_like, ones_like=jnp.ones_like,
    to_float32=lambda value: jnp.asarray(value, jnp.float32),
)

JAX_SHAPES = divisor.ShapeOps(
    convert=jnp.asarray,
    count=lambda value: jnp.asarray(jnp.size(value), jnp.float32),
    count_true=lambda mask: jnp.sum(jnp.asarray(mask, jnp.float32)),
    first_dimension=lambda value: jnp.shape(value)[0],
    leading_elements=lambda value: jnp.asarray(
        np.prod(jnp.shape(value)[:-1]), jnp.float32),
    flatten=keras.tree.flatten,
    to_float32=lambda value: jnp.asarray(value, jnp.float32),
)

# Keras's JAX loop stops before a step when the data runs out: no step
# raises, and none runs on an empty batch.
END_OF_DATA_ERRORS = ()

STEPS_PER_EXECUTION_FIX = ""

_NOT_YET = ("on the JAX backend yet; train on the TensorFlow backend "
            "(KERAS_BACKEND=tensorflow) for it")


class WindowState(typing.NamedTuple):
    """The open window's values (a JAX pytree), one entry per counter."""

    gradient_sums: list
    weight_sum: jax.Array
    loss_sum: jax.Array
    sample_sum: jax.Array
    micro_steps: jax.Array
    # Micro steps left before the epoch ends; negative when unknown.
    steps_left_in_epoch: jax.Array
    length: jax.Array
    next_length: jax.Array
    skipped_windows: jax.Array
    # The noise scale (`measure_noise_scale`; zeros otherwise): the window's
    # sum of v |g_v|^2, of v, its micro-batches with v > 0, and 0.0 while
    # its first micro-batches are missing from those sums (restored open);
    # then the epoch's summed estimates of tr(Sigma), |G|^2 and their count.
    noise_squared_norm_sum: jax.Array
    noise_weight_sum: jax.Array
    noise_micro_batches: jax.Array
    noise_measurable: jax.Array
    noise_trace_sum: jax.Array
    noise_signal_sum: jax.Array
    noise_estimates: jax.Array


def _empty_state(variables, dtype, length, steps_left_in_epoch=-1,
                 skipped_windows=0):
    def scalar(value, kind=jnp.float32):
        return jnp.asarray(value, kind)

    # Variables Keras overwrites with their "gradient" (float8 statistics)
    # keep the window's largest value, in float32, as on TensorFlow.
    return WindowState(
        gradient_sums=[
            jnp.zeros(v.shape, jnp.float32
                      if is_overwritten_with_gradient(v) else dtype)
            for v in variables],
        weight_sum=scalar(0.0), loss_sum=scalar(0.0), sample_sum=scalar(0.0),
        micro_steps=scalar(0, jnp.int32),
        steps_left_in_epoch=scalar(steps_left_in_epoch, jnp.int32),
        length=scalar(length, jnp.int32), next_length=scalar(length,
                                                             jnp.int32),
        skipped_windows=scalar(skipped_windows, jnp.int32),
        noise_squared_norm_sum=scalar(0.0), noise_weight_sum=scalar(0.0),
        noise_micro_batches=scalar(0.0), noise_measurable=scalar(1.0),
        noise_trace_sum=scalar(0.0), noise_signal_sum=scalar(0.0),
        noise_estimates=scalar(0.0),
    )


def _reset(state):
    """The state of an empty window after `state`'s (it takes the next
    window's length)."""
    return state._replace(
        gradient_sums=[jnp.zeros_like(s) for s in state.gradient_sums],
        weight_sum=jnp.zeros_like(state.weight_sum),
        loss_sum=jnp.zeros_like(state.loss_sum),
        sample_sum=jnp.zeros_like(state.sample_sum),
        micro_steps=jnp.zeros_like(state.micro_steps),
        length=state.next_length,
        noise_squared_norm_sum=jnp.zeros_like(state.noise_squared_norm_sum),
        noise_weight_sum=jnp.zeros_like(state.noise_weight_sum),
        noise_micro_batches=jnp.zeros_like(state.noise_micro_batches),
        noise_measurable=jnp.ones_like(state.noise_measurable),
    )


class Accumulation:
    """The window state of one model on JAX, and its life cycle.

    The same questions and operations as the TensorFlow window's
    `Accumulation`, answered from a `WindowState` held here between
    epochs and inside Keras's JAX state during them.

    Args:
        settings: The `Settings` to accumulate with.
    """

    def __init__(self, settings):
        _check_settings(settings)
        self.settings = settings
        self.window = None
        self.loss_scaling = None
        self.update_signal = UpdateSignal()
        self.checkpoint = None
        self.epoch = 0
        self.weight_from_batch_size = False
        # False for losses reduced with "sum": the window is their sum
        # (decided when the step is traced).
        self.divide_by_weight = True
        self._epoch_steps = -1
        self._model = None
        self._apply_open = None
        self._float16_gradients = None
        # For each trainable variable, whether the large batch's gradient
        # of it is float16 (set when the window is built).
        self.float16_flags = []
        # For each, whether Keras overwrites it with its "gradient".
        self.overwrite = []
        # The window's state inside a step being traced, else None.
        self._traced_window = None
        self._warned = set()

    def warn_once(self, message):
        """Warns with `message` once for this model."""
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(message, stacklevel=5)

    @property
    def accumulates(self):
        return self.settings.accumulates

    def window_length(self):
        return self.settings.length_for_epoch(self.epoch)

    def reconfigure(self, settings):
        """Takes new settings at a window boundary; returns whether they
        changed (see the TensorFlow window's)."""
        if settings == self.settings:
            return False
        open_steps = self.open_micro_steps()
        if open_steps:
            raise ValueError(
                "The accumulation settings can only change at a window "
                f"boundary, and the model has {window_is_open(open_steps)}. "
                f"Received: {settings!r}"
            )
        _check_settings(settings)
        if settings.accumulator_dtype != self.settings.accumulator_dtype:
            self.window = None
        self.settings = settings
        if self.window is not None:
            self._set_length(self.window_length())
        return True

    # What users read -------------------------------------------------------

    def window_left_open(self):
        open_steps = self.open_micro_steps()
        restored = self.checkpoint.restored_micro_steps
        self.checkpoint.restored_micro_steps = 0
        return 0 if open_steps == restored else open_steps

    def open_micro_steps(self):
        if self.window is None:
            return self.checkpoint.pending_count("micro_steps")
        return int(self.window.state.micro_steps)

    def skipped_windows(self):
        if self.window is None:
            return self.checkpoint.pending_count("skipped_windows")
        return int(self.window.state.skipped_windows)

    def noise_scale(self):
        """The epoch's B_noise so far, or None (see `arithmetic.noise_scale`)."""
        if self.window is None or not self.settings.measure_noise_scale:
            return None
        state = self.window.state
        return arithmetic.noise_scale(float(state.noise_trace_sum),
                                      float(state.noise_signal_sum),
                                      float(state.noise_estimates))

    def loss_totals(self):
        if self.window is None:
            return 0.0, 0.0, 0
        state = self.window.state
        return (float(state.loss_sum), float(state.weight_sum),
                int(state.micro_steps))

    def loss_since(self, start):
        if self.window is None:
            return None
        loss_sum, weight_sum, micro_steps = (
            now - before for now, before in zip(self.loss_totals(), start)
        )
        if micro_steps <= 0:
            return None
        return arithmetic.loss_of_part(loss_sum, weight_sum,
                                       self.divide_by_weight)

    def watch_updates(self, train_function, optimizer):
        return self.update_signal.watching(train_function, optimizer)

    def micro_batch_share(self):
        """1/n inside the step (see `arithmetic.micro_batch_share`); 1.0
        outside it."""
        state = self._traced_window
        if state is None:
            return 1.0
        return arithmetic.micro_batch_share(
            state.length, state.micro_steps, state.steps_left_in_epoch, 1,
            JAX_OPS)

    def accumulator_bytes(self):
        if self.window is None:
            return 0
        return sum(int(s.size) * s.dtype.itemsize
                   for s in self.window.state.gradient_sums)

    # Set-up ----------------------------------------------------------------

    def set_up(self, loss_scaling, run_eagerly, report_loss=None,
               float16_gradients=None):
        del run_eagerly, report_loss
        self.loss_scaling = loss_scaling
        self._float16_gradients = float16_gradients
        self._apply_open = None

    def check_window_fits(self, trainable_variables):
        window = self.window
        if window is None or window.matches(trainable_variables):
            return
        open_steps = self.open_micro_steps()
        if open_steps:
            raise ValueError(
                "The model's trainable weights changed while it had "
                f"{window_is_open(open_steps)}, before changing which "
                "weights are trainable. Received: "
                f"{len(list(trainable_variables))} trainable variables, "
                f"window built for {len(window.trainable_variables)}"
            )

    def build_window(self, model):
        """Builds the window for `model`'s trainable variables (eagerly,
        before the training step is traced)."""
        self._model = weakref.ref(model)
        variables = list(model.trainable_variables)
        if not variables:
            # What Keras's own TensorFlow step says; nothing is updated.
            warnings.warn("The model does not have any trainable weights.")
        if self.window is not None and self.window.matches(variables):
            return
        self.window = _Window(variables, _empty_state(
            variables, self.settings.accumulator_dtype, self.window_length(),
            self._epoch_steps))
        self._apply_open = None
        self.overwrite = [is_overwritten_with_gradient(v) for v in variables]
        self.float16_flags = [
            flag and not overwrite for flag, overwrite in zip(
                self._float16_gradients(variables)
                if self.loss_scaling is not None and self.loss_scaling.active
                and self._float16_gradients is not None
                else [False] * len(variables), self.overwrite)]
        self.checkpoint.window_built()

    def write_window(self, arrays):
        """Writes a saved window (`checkpoint_layout.read` arrays) into the
        window (eagerly). The open window keeps the length it was started
        with; the windows after it take this model's own length."""
        state = self.window.state
        gradients, _, counters = layout.window_to_write(
            arrays, [int(s.size) for s in state.gradient_sums],
            float(state.skipped_windows))
        self.window.state = state._replace(
            gradient_sums=[
                jnp.asarray(value.reshape(total.shape), total.dtype)
                for value, total in zip(gradients, state.gradient_sums)],
            **{name: jnp.asarray(counters[name], getattr(state, name).dtype)
               for name in layout.COUNTERS},
            # A window restored open is not measured: its micro-batches
            # before the checkpoint are not in the noise sums.
            noise_squared_norm_sum=jnp.asarray(0.0, jnp.float32),
            noise_weight_sum=jnp.asarray(0.0, jnp.float32),
            noise_micro_batches=jnp.asarray(0.0, jnp.float32),
            noise_measurable=jnp.asarray(
                0.0 if counters["micro_steps"] else 1.0, jnp.float32),
        )
        self._set_length(self.window_length())

    # Training --------------------------------------------------------------

    def start_epoch(self, steps, epoch=None):
        known = self.settings.flush_each_epoch and steps
        self._epoch_steps = int(steps) if known else -1
        if epoch is not None:
            self.epoch = epoch
        if self.window is not None:
            replaced = {"steps_left_in_epoch": jnp.asarray(self._epoch_steps,
                                                           jnp.int32)}
            if epoch is not None:
                # The noise scale is the epoch's own.
                replaced.update({
                    name: jnp.asarray(0.0, jnp.float32) for name in (
                        "noise_trace_sum", "noise_signal_sum",
                        "noise_estimates")})
            self.window.state = self.window.state._replace(**replaced)
            self._set_length(self.window_length())

    def _set_length(self, length):
        state = self.window.state
        # Separate arrays: Keras hands the state's buffers over to the next
        # step, and one buffer cannot be handed over twice.
        self.window.state = state._replace(
            next_length=jnp.asarray(length, jnp.int32),
            length=(jnp.asarray(length, jnp.int32)
                    if int(state.micro_steps) == 0 else state.length),
        )

    def apply_open_window(self):
        """Applies the open window to the model's variables (eagerly, with
        the state written back into them)."""
        if self.open_micro_steps() == 0:
            return
        model = self._model()
        # The optimizer the window was set up with, as on TensorFlow (a
        # recompiled model that refused to train applies its open window
        # with it).
        optimizer = self.loss_scaling.optimizer
        key = self.divide_by_weight
        if self._apply_open is None or self._apply_open[0] != key:
            self._apply_open = key, jax.jit(functools.partial(
                _end_window, self))
        state = self.window.state
        window_loss = arithmetic.window_loss(
            state.loss_sum, state.weight_sum, self.divide_by_weight, JAX_OPS)
        samples = state.sample_sum
        variables = self.window.trainable_variables
        trainable, optimizer_values, self.window.state = self._apply_open[1](
            ([v.value for v in variables],
             [v.value for v in optimizer.variables], state))
        for variable, value in zip(variables, trainable):
            variable.assign(value)
        for variable, value in zip(optimizer.variables, optimizer_values):
            variable.assign(value)
        model._loss_tracker.update_state(window_loss, sample_weight=samples)


class _Window:
    """The variables a window was built for, and its current state."""

    def __init__(self, trainable_variables, state):
        self.trainable_variables = trainable_variables
        self.state = state

    def matches(self, trainable_variables):
        current = list(trainable_variables)
        return len(current) == len(self.trainable_variables) and all(
            a is b for a, b in zip(current, self.trainable_variables))


def _check_settings(settings):
    if (settings.accumulator_dtype == "float64"
            and not jax.config.jax_enable_x64):
        raise ValueError(
            "`accumulator_dtype='float64'` needs JAX's 64-bit mode: "
            "jax.config.update('jax_enable_x64', True) before building the "
            "model, or accumulator_dtype='float32'. Received: "
            "accumulator_dtype='float64'")


def _end_window(accumulation, operands):
    """Applies the window in `operands` (trainable values, optimizer
    values, `WindowState`) with the optimizer, or skips it when it
    overflowed; returns the three with the window emptied."""
    trainable, optimizer_values, state = operands
    scaling = accumulation.loss_scaling
    total_weight = (state.weight_sum if accumulation.divide_by_weight
                    else jnp.ones_like(state.weight_sum))
    gradients = [
        total.astype(value.dtype) if overwrite else arithmetic.divide_no_nan(
            jnp.asarray(total, jnp.float32), total_weight, JAX_OPS
        ).astype(value.dtype)
        for total, value, overwrite in zip(
            state.gradient_sums, trainable, accumulation.overwrite)
    ]

    def finite():
        return jnp.all(jnp.stack(
            [jnp.all(jnp.isfinite(s)) for s in state.gradient_sums]
            or [jnp.asarray(True)]))

    def measured(state, applied):
        """`state` with the window's noise estimates added to the epoch's
        where it was `applied` (a skipped window is not measured)."""
        if not accumulation.settings.measure_noise_scale:
            return state
        summed_norm = sum(
            (jnp.sum(jnp.square(jnp.asarray(s, jnp.float32)))
             for s, overwrite in zip(state.gradient_sums,
                                     accumulation.overwrite)
             if not overwrite), jnp.asarray(0.0))
        trace, signal = arithmetic.noise_estimates(
            state.noise_squared_norm_sum, summed_norm, state.noise_weight_sum,
            state.noise_micro_batches, JAX_OPS)
        counts = jnp.logical_and(
            applied, jnp.logical_and(state.noise_micro_batches >= 2.0,
                                     state.noise_measurable > 0.0))
        return state._replace(
            noise_trace_sum=state.noise_trace_sum + jnp.where(counts, trace,
                                                              0.0),
            noise_signal_sum=state.noise_signal_sum + jnp.where(
                counts, signal, 0.0),
            noise_estimates=state.noise_estimates + jnp.where(counts, 1.0,
                                                              0.0))

    if scaling.active:
        scale = optimizer_values[scaling.scale_index()]
        flagged = [jnp.max(jnp.abs(jnp.asarray(s, jnp.float32)))
                   for s, flag in zip(state.gradient_sums,
                                      accumulation.float16_flags) if flag]
        largest = (jnp.max(jnp.stack(flagged)) if flagged
                   else jnp.asarray(0.0))
        fits = jnp.logical_and(finite(), arithmetic.fits_float16(
            largest, scale, total_weight))
        # Keras's own LossScaleOptimizer unscales, checks, applies or
        # skips, and moves the scale, as after one large batch.
        # (Keras never scales what it overwrites with the "gradient".)
        scaled = [g if overwrite
                  else jnp.where(fits, g * scale.astype(g.dtype), jnp.inf)
                  for g, overwrite in zip(gradients, accumulation.overwrite)]
        trainable, optimizer_values = scaling.optimizer.stateless_apply(
            optimizer_values, scaled, trainable)
        state = _reset(measured(state, fits))
        return list(trainable), list(optimizer_values), state._replace(
            skipped_windows=state.skipped_windows
            + jnp.where(fits, 0, 1).astype(state.skipped_windows.dtype))

    def update(operands):
        trainable, optimizer_values, state = operands
        trainable, optimizer_values = scaling.optimizer.stateless_apply(
            optimizer_values, gradients, trainable)
        return (list(trainable), list(optimizer_values),
                _reset(measured(state, True)))

    def skip(operands):
        trainable, optimizer_values, state = operands
        state = _reset(state)
        return trainable, optimizer_values, state._replace(
            skipped_windows=state.skipped_windows + 1)

    if not accumulation.settings.may_overflow:
        return update(operands)
    return jax.lax.cond(finite(), update, skip, operands)


def accumulating_train_step(model, state, data):
    """One micro step on JAX: pure, `(state, data) -> (logs, state)`."""
    accumulation = model._accumulation
    (trainable, non_trainable, optimizer_and_window,
     metrics_values) = state
    optimizer_values = list(optimizer_and_window[:-1])
    window = optimizer_and_window[-1]
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    default_weight = _has_default_micro_batch_weight(type(model))
    accumulation._traced_window = window

    def optimizer_values_in_scope():
        # Loss scaling reads the step's own values of the optimizer's
        # variables (the dynamic scale), as Keras's JAX step does.
        return keras.StatelessScope(state_mapping=list(
            zip(model.optimizer.variables, optimizer_values)))

    def scaled_loss_of(trainable):
        kwargs = {"training": True} if model._call_has_training_arg else {}
        y_pred, new_non_trainable, layer_losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs)
        if layer_losses:
            model._losses_override.clear()
            model._losses_override = layer_losses
        # This micro-batch's own mean loss; the window divides by its
        # whole weight.
        with losses.losses_not_divided_by_replicas(), \
                losses.recording_loss_reductions(JAX_SHAPES) as reductions:
            loss, (_, _, new_metrics) = model.stateless_compute_loss(
                trainable, new_non_trainable, metrics_values, x=x, y=y,
                y_pred=y_pred, sample_weight=sample_weight, training=True)
        model._traced_loss_reductions = reductions
        divisor.warn_if_activity_penalty_is_masked(
            model, y_pred, losses.get_keras_mask, JAX_SHAPES)
        # Read while `model.losses` still holds this pass's added losses.
        weight = jnp.asarray(
            model.micro_batch_weight(x, y, y_pred, sample_weight),
            jnp.float32)
        if layer_losses:
            model._losses_override.clear()
        # Losses reduced with "sum" divide by nothing: nor does the window.
        accumulation.divide_by_weight = not (
            default_weight and not accumulation.weight_from_batch_size
            and divisor.is_summed(reductions))
        with optimizer_values_in_scope():
            scaled_loss = model.get_scaled_loss(loss)
        return scaled_loss, (
            loss, y_pred, new_non_trainable, new_metrics, weight)

    (_, aux), gradients = jax.value_and_grad(scaled_loss_of, has_aux=True)(
        trainable)
    loss, y_pred, non_trainable, metrics_values, weight = aux
    with optimizer_values_in_scope():
        gradients = model.get_unscaled_gradients(gradients)

    samples = jnp.asarray(divisor.batch_size(x, JAX_SHAPES), jnp.float32)
    wide = jnp.float64 if window.gradient_sums and (
        window.gradient_sums[0].dtype == jnp.float64) else jnp.float32
    first = window.micro_steps == 0
    window = window._replace(
        gradient_sums=[
            jnp.where(first, jnp.asarray(g, jnp.float32),
                      jnp.maximum(total, jnp.asarray(g, jnp.float32)))
            if overwrite
            else total + (jnp.asarray(g, wide) * weight).astype(total.dtype)
            for total, g, overwrite in zip(
                window.gradient_sums, gradients, accumulation.overwrite)],
        weight_sum=window.weight_sum + weight,
        loss_sum=window.loss_sum + arithmetic.weighted_loss(
            jnp.asarray(loss, jnp.float32), weight, JAX_OPS),
        sample_sum=window.sample_sum + samples,
        micro_steps=window.micro_steps + 1,
        **_noise_terms(accumulation, window, gradients, weight, samples),
        steps_left_in_epoch=window.steps_left_in_epoch - 1,
    )
    ends = jnp.logical_or(window.micro_steps >= window.length,
                          window.steps_left_in_epoch == 0)
    window_loss = arithmetic.window_loss(
        window.loss_sum, window.weight_sum, accumulation.divide_by_weight,
        JAX_OPS)
    window_samples = window.sample_sum
    trainable, optimizer_values, window = jax.lax.cond(
        ends,
        functools.partial(_end_window, accumulation),
        lambda operands: operands,
        (list(trainable), optimizer_values, window),
    )

    # The loss in the logs is each window's, logged when it ends, weighted
    # by its samples as Keras weighs a batch's.
    with keras.StatelessScope(state_mapping=list(
            zip(model.metrics_variables, metrics_values))) as scope:
        model._loss_tracker.update_state(
            window_loss, sample_weight=jnp.where(ends, window_samples, 0.0))
        logs = model.compute_metrics(x, y, y_pred, sample_weight)
    metrics_values = [
        _current(scope, variable) for variable in model.metrics_variables]
    accumulation._traced_window = None
    if (accumulation.settings.may_overflow
            or accumulation.loss_scaling.active):
        # An overflow must never pass silently: show the count.
        logs = {**logs, "skipped_windows": window.skipped_windows}
    return logs, (trainable, non_trainable,
                  optimizer_values + [window], metrics_values)


def _noise_terms(accumulation, window, gradients, weight, samples):
    """The window's noise sums with this micro-batch in (see the TensorFlow
    window's `NoiseScale.add`); none when the noise scale is off."""
    if not accumulation.settings.measure_noise_scale:
        return {}
    squared_norm = sum(
        (jnp.sum(jnp.square(jnp.asarray(g, jnp.float32)))
         for g, overwrite in zip(gradients, accumulation.overwrite)
         if not overwrite), jnp.asarray(0.0))
    size = weight if accumulation.divide_by_weight else samples
    return {
        "noise_squared_norm_sum": window.noise_squared_norm_sum
        + arithmetic.noise_micro_batch_term(weight, squared_norm, size,
                                            JAX_OPS),
        "noise_weight_sum": window.noise_weight_sum + size,
        "noise_micro_batches": window.noise_micro_batches
        + jnp.where(size > 0, 1.0, 0.0),
    }


def _current(scope, variable):
    value = scope.get_current_value(variable)
    return variable.value if value is None else value


class ModelDifferences:
    """What the Keras 3 `AccumulatingModel` does on JAX: its window rides
    in Keras's JAX state."""

    def make_train_function(self, force=False):
        accumulation = self._accumulation
        if accumulation.accumulates and (force or self.train_function is None):
            # The model and its optimizer are built by now (Keras builds
            # them symbolically before it makes the train function).
            accumulation.build_window(self)
        return super().make_train_function(force)

    def _get_jax_state(self, trainable_variables=False,
                       non_trainable_variables=False,
                       optimizer_variables=False, metrics_variables=False,
                       purge_model_variables=False):
        state = super()._get_jax_state(
            trainable_variables=trainable_variables,
            non_trainable_variables=non_trainable_variables,
            optimizer_variables=optimizer_variables,
            metrics_variables=metrics_variables,
            purge_model_variables=purge_model_variables,
        )
        window = self._accumulation.window
        if (optimizer_variables and self._accumulation.accumulates
                and window is not None):
            index = int(trainable_variables) + int(non_trainable_variables)
            state = list(state)
            state[index] = list(state[index]) + [window.state]
            state = tuple(state)
        return state

    def jax_state_sync(self):
        jax_state = getattr(self, "_jax_state", None)
        window = self._accumulation.window
        if jax_state and not self._jax_state_synced and window is not None:
            values = jax_state.get("optimizer_variables") or []
            if len(values) == len(self.optimizer.variables) + 1:
                # Keras's attribute tracking wraps the lists it is handed
                # (`_jax_state`): JAX takes plain ones.
                state = values[-1]
                window.state = state._replace(
                    gradient_sums=list(state.gradient_sums))
        super().jax_state_sync()


class UpdateSignal:
    """Whether the last run of the train function applied an update.

    Copies the optimizer's `iterations` from the state before and after each
    run (the state's own arrays are handed over to the next run). Once
    Keras has written the state back into the variables (a callback's
    `self.model` does; so does an epoch's end, where the open window may
    be applied), the variable itself is the count after.
    """

    def __init__(self):
        self._before = self._after = None
        self._iterations = None

    def watching(self, train_function, optimizer):
        self._iterations = optimizer.iterations
        index = next(i for i, v in enumerate(optimizer.variables)
                     if v is optimizer.iterations)

        def train_function_noting_updates(state, *args):
            optimizer_position = len(state) - 2
            self._before = jnp.array(state[optimizer_position][index])
            logs, state = train_function(state, *args)
            self._after = jnp.array(state[optimizer_position][index])
            return logs, state

        return train_function_noting_updates

    def applied(self):
        if self._before is None:
            return False
        # Keras empties a variable (private `_value`) while the state it
        # trains on lives elsewhere.
        written_back = getattr(self._iterations, "_value", None) is not None
        after = self._iterations.value if written_back else self._after
        return int(after) > int(self._before)


class LossScaling:
    """The compiled optimizer's duties on JAX, taken apart for windows.

    Each micro step scales its loss by the `LossScaleOptimizer`'s dynamic
    scale S times its share of the window (1/n), and unscales its
    gradients by the same, read from the step's own optimizer values. The
    window end hands the `LossScaleOptimizer` the window's mean gradient
    scaled by S again, or inf where the window overflowed (a non-finite
    sum, or a float16 weight gradient whose sum the large batch could not
    hold): its own `stateless_apply` then unscales and applies, or skips,
    and moves the scale, exactly as after one large batch. A static
    `loss_scale_factor` multiplies the loss and the optimizer divides it
    out. Reads `dynamic_scale` (public), checked on keras 3.15.1.

    Args:
        optimizer: The compiled optimizer, a `LossScaleOptimizer` or not.
    """

    counts_skipped_steps = False

    def __init__(self, optimizer):
        self.optimizer = optimizer
        if isinstance(optimizer, optimizers.LossScaleOptimizer):
            self.loss_scale_optimizer = optimizer
            self.update_optimizer = optimizer.inner_optimizer
        else:
            self.loss_scale_optimizer = None
            self.update_optimizer = optimizer

    @property
    def active(self):
        return self.loss_scale_optimizer is not None

    def current_scale(self):
        """S, read inside the step's `StatelessScope` (its traced value)."""
        return jnp.asarray(
            keras.ops.convert_to_tensor(self.loss_scale_optimizer
                                        .dynamic_scale), jnp.float32)

    def scale_loss(self, loss, share=1.0):
        factor = getattr(self.update_optimizer, "loss_scale_factor", None)
        if factor is not None:
            loss = loss * factor
        if not self.active:
            return loss
        return loss * (self.current_scale() * share).astype(loss.dtype)

    def unscale_gradients(self, gradients, variables=None, share=1.0):
        if not self.active:
            return gradients
        keep = [is_overwritten_with_gradient(v)
                for v in (variables or [None] * len(gradients))]
        factor = 1.0 / (self.current_scale() * share)
        return [g if kept else g * factor.astype(g.dtype)
                for g, kept in zip(gradients, keep)]

    def scale_index(self):
        """Where S sits among the optimizer's variables."""
        lso = self.loss_scale_optimizer
        return next(i for i, v in enumerate(lso.variables)
                    if v is lso.dynamic_scale)


class WindowCheckpoint(KerasSaveable):
    """The open window in Keras files (`save_weights`, `.keras`,
    `ModelCheckpoint`, `BackupAndRestore`), laid out as on TensorFlow
    (`core.checkpoint_layout`): a file saved on either backend restores on
    the other. Keras's saver visits this attribute of the model as it does
    on TensorFlow (see `tensorflow_saving`).

    Args:
        accumulation: The `Accumulation` whose window is saved.
    """

    def __init__(self, accumulation):
        self._accumulation = weakref.ref(accumulation)
        # A restored window waiting for the model to build its own.
        self._pending = None
        self.restored_micro_steps = 0

    def _obj_type(self):
        return "Layer"

    def save_own_variables(self, store):
        accumulation = self._accumulation()
        window = accumulation.window
        if window is None and self._pending is None:
            return
        if window is None:
            arrays = self._pending
        else:
            state = window.state
            arrays = layout.saved_state(
                [np.asarray(s) for s in state.gradient_sums],
                [True] * len(state.gradient_sums),
                {name: float(getattr(state, name))
                 for name in layout.COUNTERS},
            )
        for key, value in arrays.items():
            store[key] = value

    def load_own_variables(self, store):
        arrays = layout.read({key: store[key] for key in store.keys()})
        self.restored_micro_steps = int(layout.counter(arrays,
                                                       "micro_steps"))
        accumulation = self._accumulation()
        if accumulation.window is None:
            self._pending = arrays
        else:
            self._pending = None
            accumulation.write_window(arrays)

    def window_built(self):
        """Writes a restored window into the window just built."""
        if self._pending is not None:
            arrays, self._pending = self._pending, None
            self._accumulation().write_window(arrays)

    def pending_count(self, name):
        if self._pending is None:
            return 0
        return int(layout.counter(self._pending, name))


def check_strategy(model):
    """Refuses `keras.distribution` (one device on JAX for now)."""
    del model
    distribution = keras.distribution.distribution()
    if distribution is not None:
        raise ValueError(
            "AccumulatingModel trains on one device on JAX for now, and "
            f"{type(distribution).__name__} is set "
            f"(keras.distribution.set_distribution); several devices "
            f"train {_NOT_YET}, or call "
            "keras.distribution.set_distribution(None). Received: "
            f"distribution={type(distribution).__name__}")


def replicas_in_sync(model):
    del model
    return 1


def default_micro_batch_weight(model, x, y_pred):
    """What Keras divided this micro step's loss by (inside the step)."""
    if model._accumulation.weight_from_batch_size:
        return jnp.asarray(divisor.batch_size(x, JAX_SHAPES), jnp.float32)
    weight = divisor.micro_batch_weight(
        getattr(model, "_traced_loss_reductions", []),
        lambda: divisor.fallback_divisor(x, y_pred, losses.get_keras_mask,
                                         JAX_SHAPES),
        type(model).__name__, has_other_losses=bool(model.losses),
    )
    return jnp.asarray(1.0) if weight is divisor.SUM else weight


def accumulate_gradients(model, gradients, weight, batch_size=None):
    del model, gradients, weight, batch_size
    raise NotImplementedError(
        "`accumulate_gradients` hands gradients to a stateful window, and a "
        f"training step of your own is stateless {_NOT_YET}.")


def executions_stop_cleanly_at_end_of_data():
    """Keras's JAX loop runs an execution's steps one by one and stops
    between two when the data runs out."""
    return True


def foreign_variables_in_graph(model):
    del model
    return []


def is_foreign_layer(value):
    """No Keras 2 layer can sit in a model on JAX (Keras 2 is TensorFlow's)."""
    del value
    return False


def logs_for_reduction(logs, strategy):
    del strategy
    return logs


def pools_moving_statistics(layer):
    """On JAX, BatchNormalization layers move their moving statistics on
    each micro-batch (`fit()` warns)."""
    del layer
    return False


@contextlib.contextmanager
def recording_batch_statistics(layers):
    del layers
    yield []


def _has_default_micro_batch_weight(model_class):
    base = class_tree.accumulating_base(model_class)
    return model_class.micro_batch_weight is base.micro_batch_weight
