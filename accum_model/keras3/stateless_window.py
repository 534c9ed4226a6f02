"""Keras 3 on JAX: the window's state, life cycle and end.

The window is a `WindowState` (a JAX pytree of accumulators and counters):
held by `Accumulation` between epochs, and inside Keras's JAX state during
them (see `jax_training`). `end_window` applies it with the optimizer's own
`stateless_apply`, in the training step or eagerly at an epoch's end; its
numbers are `accum_model.core.arithmetic`'s, and its file layout is
`core.checkpoint_layout`'s, as on TensorFlow. Checked on keras 3.15.1 with
jax 0.10.2.
"""

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
from accum_model.core.lifecycle import WindowLifecycle
from accum_model.core.messages import window_is_open
from accum_model.core.optimizer_duties import OptimizerDuties
from accum_model.core.variables import is_overwritten_with_gradient
from accum_model.keras3.jax_normalization import PooledStatistics
from accum_model.keras3.jax_ops import JAX_OPS

__all__ = ["Accumulation", "LossScaling", "WindowCheckpoint"]



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
    # BatchNormalization's pooled moments: per pooled layer, [3, channels]
    # of element count, shifted sum and shifted sum of squares.
    statistics_sums: list


def _empty_state(variables, dtype, length, steps_left_in_epoch=-1,
                 skipped_windows=0, statistics_sums=()):
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
        statistics_sums=list(statistics_sums),
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
        statistics_sums=[jnp.zeros_like(s) for s in state.statistics_sums],
    )


class Accumulation(WindowLifecycle):
    """The window state of one model on JAX, and its life cycle.

    The same questions and operations as the TensorFlow window's
    `Accumulation`, answered from a `WindowState` held here between
    epochs and inside Keras's JAX state during them.

    Args:
        settings: The `Settings` to accumulate with.
    """

    def __init__(self, settings):
        _check_settings(settings)
        super().__init__(settings)
        self.update_signal = UpdateSignal()
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
        # The window's state inside a step being traced, else None.
        self._traced_window = None
        # The layers whose moving statistics the window pools (set when
        # the window is built).
        self.statistics = None
        # The window's layout under `keras.distribution` (set as the step's
        # state is gathered), else None.
        self.window_sharding = None

    # What `WindowLifecycle` asks of a backend --------------------------------

    def _window_count(self, name):
        return int(getattr(self.window.state, name))

    def _tracks_loss(self):
        return True  # The built-in step is the only step on JAX.

    def _divides_by_weight(self):
        return self.divide_by_weight

    def _check_settings(self, settings):
        _check_settings(settings)

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
            statistics_sums=[
                jnp.asarray(value, jnp.float32)
                for value in layout.statistics_to_write(
                    arrays, [tuple(s.shape) for s in state.statistics_sums],
                    counters)],
        )
        self._set_window_length(self.window_length())

    # Training --------------------------------------------------------------

    def start_epoch(self, steps, epoch=None):
        self._start_epoch_counts(steps, epoch)
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
            self._set_window_length(self.window_length())

    def _set_window_length(self, length):
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
                end_window, self))
        state = self.window.state
        window_loss = arithmetic.window_loss(
            state.loss_sum, state.weight_sum, self.divide_by_weight, JAX_OPS)
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


class _Window:
    """The variables a window was built for, and its current state."""

    def __init__(self, trainable_variables, state):
        self.trainable_variables = trainable_variables
        self.state = state

    def sharding(self, trainable_shardings):
        """The window's shardings under `keras.distribution`: each gradient
        sum is laid out as its variable, every counter replicated."""
        trainable_shardings = list(trainable_shardings)
        replicated = _replicated_like(
            trainable_shardings[0] if trainable_shardings else None)
        return jax.tree.map(lambda _: replicated, self.state)._replace(
            gradient_sums=[
                sharding if total.ndim else replicated
                for sharding, total in zip(trainable_shardings,
                                           self.state.gradient_sums)])

    def matches(self, trainable_variables):
        current = list(trainable_variables)
        return len(current) == len(self.trainable_variables) and all(
            a is b for a, b in zip(current, self.trainable_variables))


def _replicated_like(sharding):
    """A sharding that keeps a whole copy on each device of `sharding`'s."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh,
                                          jax.sharding.PartitionSpec())
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return sharding


def _check_settings(settings):
    if (settings.accumulator_dtype == "float64"
            and not jax.config.jax_enable_x64):
        raise ValueError(
            "`accumulator_dtype='float64'` needs JAX's 64-bit mode: "
            "jax.config.update('jax_enable_x64', True) before building the "
            "model, or accumulator_dtype='float32'. Received: "
            "accumulator_dtype='float64'")


def end_window(accumulation, operands):
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


class LossScaling(OptimizerDuties):
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
        super().__init__(optimizer, optimizers.LossScaleOptimizer)

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
            [np.asarray(s) for s in state.gradient_sums],
            [True] * len(state.gradient_sums),
            {name: float(getattr(state, name)) for name in layout.COUNTERS},
            [np.asarray(s) for s in state.statistics_sums],
        )

    def save_own_variables(self, store):
        arrays = self.saved_state()
        for key, value in (arrays or {}).items():
            store[key] = value

    def load_own_variables(self, store):
        self.restore_state({key: store[key] for key in store.keys()})

    def _window_exists(self):
        return self._accumulation().window is not None

    def _write(self, arrays):
        self._accumulation().write_window(arrays)
