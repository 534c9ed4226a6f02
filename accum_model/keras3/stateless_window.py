"""Keras 3 on JAX and PyTorch: the window as values.

The window is a `WindowState` (a pytree of accumulators and counters),
written once with `keras.ops`: JAX runs it inside its jitted training step
(its state rides in Keras's JAX state, see `jax_training`), PyTorch runs it
eagerly (see `torch_training`). `add_micro_batch` adds a micro-batch;
`end_window` applies the window with the optimizer's own
`stateless_apply`, or skips it on overflow, in the step or at an epoch's
end. Its numbers are `accum_model.core.arithmetic`'s, and its file layout
is `core.checkpoint_layout`'s, as on TensorFlow. Each backend's module
subclasses `Accumulation` for what only it has. Checked on keras 3.15.1
with jax 0.10.2 and torch 2.13.0.
"""

import functools
import math
import typing
import warnings
import weakref

import keras
import numpy as np
from keras import ops
from keras import optimizers
from keras.src.saving.keras_saveable import KerasSaveable

from accum_model.core import arithmetic
from accum_model.core import checkpoint_layout as layout
from accum_model.core.lifecycle import WindowLifecycle
from accum_model.core.messages import window_is_open
from accum_model.core.optimizer_duties import OptimizerDuties
from accum_model.core.variables import is_overwritten_with_gradient
from accum_model.keras3 import learning_rate
from accum_model.keras3.stateless_normalization import PooledStatistics
from accum_model.keras3.stateless_ops import KERAS_OPS

# Used by the backends' modules; nothing of the adapter's own.
__all__ = []

class WindowState(typing.NamedTuple):
    """The open window's values (a pytree of the backend's arrays), one
    entry per counter."""

    gradient_sums: list
    weight_sum: typing.Any
    loss_sum: typing.Any
    sample_sum: typing.Any
    micro_steps: typing.Any
    # Micro steps left before the epoch ends; negative when unknown.
    steps_left_in_epoch: typing.Any
    length: typing.Any
    next_length: typing.Any
    skipped_windows: typing.Any
    # The noise scale (`measure_noise_scale`; zeros otherwise): the window's
    # sum of v |g_v|^2, of v, its micro-batches with v > 0, and 0.0 while
    # its first micro-batches are missing from those sums (restored open);
    # then the epoch's summed estimates of tr(Sigma), |G|^2 and their count.
    noise_squared_norm_sum: typing.Any
    noise_weight_sum: typing.Any
    noise_micro_batches: typing.Any
    noise_measurable: typing.Any
    noise_trace_sum: typing.Any
    noise_signal_sum: typing.Any
    noise_estimates: typing.Any
    # BatchNormalization's pooled moments: per pooled layer, [3, channels]
    # of element count, shifted sum and shifted sum of squares.
    statistics_sums: list
    # What the window end multiplies a scaled learning-rate schedule by
    # (`learning_rate.WindowScaledSchedule`; 1.0 without one).
    learning_rate_scale: typing.Any


def _empty_state(variables, dtype, length, steps_left_in_epoch=-1,
                 skipped_windows=0, statistics_sums=()):
    def scalar(value, kind="float32"):
        return ops.cast(value, kind)

    # Variables Keras overwrites with their "gradient" (float8 statistics)
    # keep the window's largest value, in float32, as on TensorFlow.
    return WindowState(
        gradient_sums=[
            ops.zeros(v.shape, "float32"
                      if is_overwritten_with_gradient(v) else dtype)
            for v in variables],
        weight_sum=scalar(0.0), loss_sum=scalar(0.0), sample_sum=scalar(0.0),
        micro_steps=scalar(0, "int32"),
        steps_left_in_epoch=scalar(steps_left_in_epoch, "int32"),
        length=scalar(length, "int32"), next_length=scalar(length,
                                                             "int32"),
        skipped_windows=scalar(skipped_windows, "int32"),
        noise_squared_norm_sum=scalar(0.0), noise_weight_sum=scalar(0.0),
        noise_micro_batches=scalar(0.0), noise_measurable=scalar(1.0),
        noise_trace_sum=scalar(0.0), noise_signal_sum=scalar(0.0),
        noise_estimates=scalar(0.0),
        statistics_sums=list(statistics_sums),
        learning_rate_scale=scalar(1.0),
    )


def _reset(state):
    """The state of an empty window after `state`'s (it takes the next
    window's length)."""
    return state._replace(
        gradient_sums=[ops.zeros_like(s) for s in state.gradient_sums],
        weight_sum=ops.zeros_like(state.weight_sum),
        loss_sum=ops.zeros_like(state.loss_sum),
        sample_sum=ops.zeros_like(state.sample_sum),
        micro_steps=ops.zeros_like(state.micro_steps),
        length=state.next_length,
        noise_squared_norm_sum=ops.zeros_like(state.noise_squared_norm_sum),
        noise_weight_sum=ops.zeros_like(state.noise_weight_sum),
        noise_micro_batches=ops.zeros_like(state.noise_micro_batches),
        noise_measurable=ops.ones_like(state.noise_measurable),
        statistics_sums=[ops.zeros_like(s) for s in state.statistics_sums],
    )


class Accumulation(WindowLifecycle):
    """The window state of one model on JAX or PyTorch, and its life cycle.

    The same questions and operations as the TensorFlow window's
    `Accumulation`, answered from a `WindowState` held here (and, on JAX,
    inside Keras's JAX state during epochs). A backend's subclass says
    how the open window's end runs eagerly (`_eager_end`), which settings
    it refuses (`_check_settings`) and how updates are noticed
    (`update_signal`).

    Args:
        settings: The `Settings` to accumulate with.
    """

    def __init__(self, settings):
        self._check_settings(settings)
        super().__init__(settings)
        # False for losses reduced with "sum": the window is their sum
        # (decided when the step is traced).
        self.divide_by_weight = True
        self._model = None
        self._apply_open = None
        self._float16_gradients = None
        # For each trainable variable, whether the large batch's gradient
        # of it is float16 (set when the window is built).
        self.float16_flags = []
        # For each, whether Keras overwrites it with its "gradient".
        self.overwrite = []
        # For each, whether a micro-batch of the open window gave it a
        # gradient; None where every variable always has one (a traced
        # step's gradients are never missing).
        self.has_gradient = None
        # The window's state inside a step being traced, else None.
        self._traced_window = None
        # The layers whose moving statistics the window pools (set when
        # the window is built).
        self.statistics = None

    # What `WindowLifecycle` asks of a backend --------------------------------

    def _window_count(self, name):
        return int(getattr(self.window.state, name))

    def _tracks_loss(self):
        return True  # The built-in step is the only step on JAX.

    def _divides_by_weight(self):
        return self.divide_by_weight

    def _check_settings(self, settings):
        """Raises ValueError for settings this backend cannot keep."""

    def _eager_end(self, end):
        """`end` (`end_window` with this accumulation bound), as the
        backend runs it outside a training step."""
        return end

    def _settled(self, ends):
        """Whether the window ends, as the step goes on with it: the
        traced value where both branches are traced (JAX), a Python bool
        where the step runs eagerly and a branch not taken costs its work."""
        return ends

    # What users read -------------------------------------------------------

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
            KERAS_OPS)

    def accumulator_bytes(self):
        if self.window is None:
            return 0
        return sum(_elements(s) * np.dtype(
            keras.backend.standardize_dtype(s.dtype)).itemsize
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
        # What the window end needs to know of the variables follows the
        # compiled optimizer (a recompile may add loss scaling to a window
        # that is kept).
        self._apply_open = None
        self.overwrite = [is_overwritten_with_gradient(v) for v in variables]
        self.float16_flags = [
            flag and not overwrite for flag, overwrite in zip(
                self._float16_gradients(variables)
                if self.loss_scaling is not None and self.loss_scaling.active
                and self._float16_gradients is not None
                else [False] * len(variables), self.overwrite)]
        # Where each layer's moving statistics sit among the non-trainable
        # variables follows which weights are trainable now.
        self.statistics = PooledStatistics(model)
        if self.window is not None and self.window.matches(variables):
            return
        self.window = _Window(variables, _empty_state(
            variables, self.settings.accumulator_dtype, self.window_length(),
            self._epoch_steps,
            statistics_sums=self.statistics.empty_sums()))
        self.follow_learning_rate_scale()
        self.checkpoint.window_built()

    def write_window(self, arrays):
        """Writes a saved window (`checkpoint_layout.read` arrays) into the
        window (eagerly). The open window keeps the length it was started
        with; the windows after it take this model's own length."""
        state = self.window.state
        gradients, _, counters = layout.window_to_write(
            arrays, [_elements(s) for s in state.gradient_sums],
            float(state.skipped_windows))
        self.window.state = state._replace(
            gradient_sums=[
                ops.cast(value.reshape(total.shape), total.dtype)
                for value, total in zip(gradients, state.gradient_sums)],
            **{name: ops.cast(counters[name], getattr(state, name).dtype)
               for name in layout.COUNTERS},
            # A window restored open is not measured: its micro-batches
            # before the checkpoint are not in the noise sums.
            noise_squared_norm_sum=ops.cast(0.0, "float32"),
            noise_weight_sum=ops.cast(0.0, "float32"),
            noise_micro_batches=ops.cast(0.0, "float32"),
            noise_measurable=ops.cast(
                0.0 if counters["micro_steps"] else 1.0, "float32"),
            statistics_sums=[
                ops.cast(value, "float32")
                for value in layout.statistics_to_write(
                    arrays, [tuple(s.shape) for s in state.statistics_sums],
                    counters)],
        )
        self._set_window_length(self.window_length())

    # Training --------------------------------------------------------------

    def start_epoch(self, steps, epoch=None):
        self._start_epoch_counts(steps, epoch)
        if self.window is not None:
            replaced = {"steps_left_in_epoch": ops.cast(self._epoch_steps,
                                                           "int32")}
            if epoch is not None:
                # The noise scale is the epoch's own.
                replaced.update({
                    name: ops.cast(0.0, "float32") for name in (
                        "noise_trace_sum", "noise_signal_sum",
                        "noise_estimates")})
            self.window.state = self.window.state._replace(**replaced)
            self._set_window_length(self.window_length())
            self.follow_learning_rate_scale()

    def follow_learning_rate_scale(self):
        """Copies the scale of the optimizer's scaled schedule into the
        window (eagerly, as it is built and between epochs), where the
        window end reads it."""
        model = self._model() if self._model is not None else None
        if self.window is None or model is None or model.optimizer is None:
            return
        self.window.state = self.window.state._replace(
            learning_rate_scale=ops.cast(
                learning_rate.learning_rate_scale(model.optimizer),
                "float32"))

    def _set_window_length(self, length):
        state = self.window.state
        # Separate arrays: Keras hands the state's buffers over to the next
        # step, and one buffer cannot be handed over twice.
        self.window.state = state._replace(
            next_length=ops.cast(length, "int32"),
            length=(ops.cast(length, "int32")
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
            self._apply_open = key, self._eager_end(functools.partial(
                end_window, self))
        state = self.window.state
        window_loss = arithmetic.window_loss(
            state.loss_sum, state.weight_sum, self.divide_by_weight,
            KERAS_OPS)
        samples = state.sample_sum
        # The large batch's forward pass moves the moving statistics
        # whether or not its update is then skipped for overflow.
        self.statistics.move_variables(state.statistics_sums, model)
        variables = self.window.trainable_variables
        trainable, optimizer_values, self.window.state = self._apply_open[1](
            ([v.value for v in variables],
             [v.value for v in optimizer.variables], state))
        for variable, value in zip(variables, trainable):
            variable.assign(value)
        for variable, value in zip(optimizer.variables, optimizer_values):
            variable.assign(value)
        model._loss_tracker.update_state(window_loss, sample_weight=samples)


def _elements(array):
    return math.prod(tuple(array.shape))


class _Window:
    """The variables a window was built for, and its current state."""

    def __init__(self, trainable_variables, state):
        self.trainable_variables = trainable_variables
        self.state = state

    def matches(self, trainable_variables):
        current = list(trainable_variables)
        return len(current) == len(self.trainable_variables) and all(
            a is b for a, b in zip(current, self.trainable_variables))


def add_micro_batch(accumulation, trainable, optimizer_values, window,
                     gradients, weight, loss, samples, non_trainable=None,
                     moments=None):
    """Adds a micro-batch (and its normalization layers' `moments`) to the
    window and applies the window when it is due; returns the new
    (trainable, non-trainable, optimizer values, window), whether the
    window ended, its loss and its samples."""
    wide = "float64" if window.gradient_sums and (
        keras.backend.standardize_dtype(window.gradient_sums[0].dtype)
        == "float64") else "float32"
    first = window.micro_steps == 0
    window = window._replace(
        gradient_sums=[
            ops.where(first, ops.cast(g, "float32"),
                      ops.maximum(total, ops.cast(g, "float32")))
            if overwrite
            else total + ops.cast(ops.cast(g, wide) * ops.cast(weight, wide),
                                  total.dtype)
            for total, g, overwrite in zip(
                window.gradient_sums, gradients, accumulation.overwrite)],
        weight_sum=window.weight_sum + weight,
        loss_sum=window.loss_sum + arithmetic.weighted_loss(
            ops.cast(loss, "float32"), weight, KERAS_OPS),
        sample_sum=window.sample_sum + samples,
        micro_steps=window.micro_steps + 1,
        **noise_terms(accumulation, window, gradients, weight, samples),
        steps_left_in_epoch=window.steps_left_in_epoch - 1,
    )
    if moments is not None:
        window = window._replace(statistics_sums=accumulation.statistics.added(
            window.statistics_sums, moments, non_trainable))
    ends = accumulation._settled(ops.logical_or(
        window.micro_steps >= window.length, window.steps_left_in_epoch == 0))
    window_loss = arithmetic.window_loss(
        window.loss_sum, window.weight_sum, accumulation.divide_by_weight,
        KERAS_OPS)
    window_samples = window.sample_sum
    if moments is not None:
        # Moved whether the update is applied or skipped for overflow, as
        # the large batch's forward pass moves them.
        non_trainable = accumulation.statistics.moved(
            window.statistics_sums, non_trainable, ends)
    operands = (list(trainable), optimizer_values, window)
    trainable, optimizer_values, window = ops.cond(
        ends, lambda: end_window(accumulation, operands), lambda: operands)
    return (trainable, non_trainable, optimizer_values, window, ends,
            window_loss, window_samples)


def noise_terms(accumulation, window, gradients, weight, samples):
    """The window's noise sums with this micro-batch in (see the TensorFlow
    window's `NoiseScale.add`); none when the noise scale is off."""
    if not accumulation.settings.measure_noise_scale:
        return {}
    squared_norm = sum(
        (ops.sum(ops.square(ops.cast(g, "float32")))
         for g, overwrite in zip(gradients, accumulation.overwrite)
         if not overwrite), ops.convert_to_tensor(0.0, "float32"))
    size = weight if accumulation.divide_by_weight else samples
    return {
        "noise_squared_norm_sum": window.noise_squared_norm_sum
        + arithmetic.noise_micro_batch_term(weight, squared_norm, size,
                                            KERAS_OPS),
        "noise_weight_sum": window.noise_weight_sum + size,
        "noise_micro_batches": window.noise_micro_batches
        + ops.where(size > 0, 1.0, 0.0),
    }


def end_window(accumulation, operands):
    """Applies the window in `operands` (trainable values, optimizer
    values, `WindowState`) with the optimizer, or skips it when it
    overflowed; returns the three with the window emptied."""
    trainable, optimizer_values, state = operands
    scaling = accumulation.loss_scaling
    total_weight = (state.weight_sum if accumulation.divide_by_weight
                    else ops.ones_like(state.weight_sum))
    # A variable no micro-batch of the window gave a gradient gets none, as
    # in the large batch (only an eager step can leave one out).
    present = accumulation.has_gradient or [True] * len(trainable)
    gradients = [
        None if not used else ops.cast(total, value.dtype) if overwrite
        else ops.cast(
            arithmetic.divide_no_nan(ops.cast(total, "float32"),
                                     total_weight, KERAS_OPS),
            value.dtype)
        for total, value, overwrite, used in zip(
            state.gradient_sums, trainable, accumulation.overwrite, present)
    ]

    def finite():
        return ops.all(ops.stack(
            [ops.all(ops.isfinite(s)) for s in state.gradient_sums]
            or [ops.convert_to_tensor(True)]))

    def measured(state, applied):
        """`state` with the window's noise estimates added to the epoch's
        where it was `applied` (a skipped window is not measured)."""
        if not accumulation.settings.measure_noise_scale:
            return state
        summed_norm = sum(
            (ops.sum(ops.square(ops.cast(s, "float32")))
             for s, overwrite in zip(state.gradient_sums,
                                     accumulation.overwrite)
             if not overwrite), ops.convert_to_tensor(0.0))
        trace, signal = arithmetic.noise_estimates(
            state.noise_squared_norm_sum, summed_norm, state.noise_weight_sum,
            state.noise_micro_batches, KERAS_OPS)
        counts = ops.logical_and(
            applied, ops.logical_and(state.noise_micro_batches >= 2.0,
                                     state.noise_measurable > 0.0))
        return state._replace(
            noise_trace_sum=state.noise_trace_sum + ops.where(counts, trace,
                                                              0.0),
            noise_signal_sum=state.noise_signal_sum + ops.where(
                counts, signal, 0.0),
            noise_estimates=state.noise_estimates + ops.where(counts, 1.0,
                                                              0.0))

    if scaling.active:
        scale = optimizer_values[scaling.scale_index()]
        flagged = [ops.max(ops.abs(ops.cast(s, "float32")))
                   for s, flag in zip(state.gradient_sums,
                                      accumulation.float16_flags) if flag]
        largest = (ops.max(ops.stack(flagged)) if flagged
                   else ops.convert_to_tensor(0.0))
        fits = ops.logical_and(finite(), arithmetic.fits_float16(
            largest, scale, total_weight))
        # Keras's own LossScaleOptimizer unscales, checks, applies or
        # skips, and moves the scale, as after one large batch.
        # (Keras never scales what it overwrites with the "gradient".)
        scaled = [g if overwrite or g is None
                  else ops.where(fits, g * ops.cast(scale, g.dtype),
                                 float("inf"))
                  for g, overwrite in zip(gradients, accumulation.overwrite)]
        with learning_rate.scaled_by(scaling.optimizer,
                                     state.learning_rate_scale):
            trainable, optimizer_values = scaling.optimizer.stateless_apply(
                optimizer_values, scaled, trainable)
        state = _reset(measured(state, fits))
        return list(trainable), list(optimizer_values), state._replace(
            skipped_windows=state.skipped_windows
            + ops.cast(ops.logical_not(fits), state.skipped_windows.dtype))

    def update(operands):
        trainable, optimizer_values, state = operands
        with learning_rate.scaled_by(scaling.optimizer,
                                     state.learning_rate_scale):
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
    return ops.cond(finite(), lambda: update(operands),
                    lambda: skip(operands))


class LossScaling(OptimizerDuties):
    """The compiled optimizer's duties on JAX and PyTorch, taken apart for
    windows.

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
        super().__init__(optimizer, optimizers.LossScaleOptimizer)

    def current_scale(self):
        """S, read inside the step's `StatelessScope` (its traced value)."""
        return ops.cast(
            keras.ops.convert_to_tensor(self.loss_scale_optimizer
                                        .dynamic_scale), "float32")

    def scale_loss(self, loss, share=1.0):
        factor = getattr(self.update_optimizer, "loss_scale_factor", None)
        if factor is not None:
            loss = loss * factor
        if not self.active:
            return loss
        return loss * ops.cast(self.current_scale() * share, loss.dtype)

    def unscale_gradients(self, gradients, variables=None, share=1.0):
        if not self.active:
            return gradients
        keep = [is_overwritten_with_gradient(v)
                for v in (variables or [None] * len(gradients))]
        factor = 1.0 / (self.current_scale() * share)
        return [g if kept else g * ops.cast(factor, g.dtype)
                for g, kept in zip(gradients, keep)]

    def scale_index(self):
        """Where S sits among the optimizer's variables."""
        lso = self.loss_scale_optimizer
        return next(i for i, v in enumerate(lso.variables)
                    if v is lso.dynamic_scale)


class WindowCheckpoint(KerasSaveable, layout.RestoredWindow):
    """The open window in Keras files (`save_weights`, `.keras`,
    `ModelCheckpoint`, `BackupAndRestore`), laid out as on TensorFlow
    (`core.checkpoint_layout`): a file saved on either backend restores on
    the other. Keras's saver visits this attribute of the model as it does
    on TensorFlow (see `tensorflow_saving`).

    Args:
        accumulation: The `Accumulation` whose window is saved.
    """

    def __init__(self, accumulation):
        layout.RestoredWindow.__init__(self)
        self._accumulation = weakref.ref(accumulation)

    def _obj_type(self):
        return "Layer"

    def saved_state(self):
        """The window's arrays as a file holds them (`core.checkpoint_layout`),
        or None when there is no window to save."""
        window = self._accumulation().window
        if window is None:
            return self._pending
        state = window.state
        return layout.saved_state(
            [ops.convert_to_numpy(s) for s in state.gradient_sums],
            [True] * len(state.gradient_sums),
            {name: float(getattr(state, name)) for name in layout.COUNTERS},
            [ops.convert_to_numpy(s) for s in state.statistics_sums],
        )

    def save_own_variables(self, store):
        arrays = self.with_sizer_state(self.saved_state())
        for key, value in (arrays or {}).items():
            store[key] = value

    def load_own_variables(self, store):
        self.restore_state({key: store[key] for key in store.keys()})

    def _window_exists(self):
        return self._accumulation().window is not None

    def _write(self, arrays):
        self._accumulation().write_window(arrays)
