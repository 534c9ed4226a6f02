"""Keras 3 on JAX and PyTorch: the store that runs the window as values.

The window's state and transitions are `accum_model.core.window`'s, run
with `keras.ops`: JAX runs them inside its jitted training step (the
state rides in Keras's JAX state, see `jax_adapter`), PyTorch eagerly
(see `torch_adapter`). `add_micro_batch` adds a micro-batch;
`end_window` applies the window with the optimizer's own
`stateless_apply`, or skips it on overflow, in the step or at an epoch's
end. Its file layout is `core.checkpoint_layout`'s, as on TensorFlow.
Each backend's module subclasses `Accumulation` for what only it has.
Checked on keras 3.15.1 with jax 0.10.2 and torch 2.13.0.
"""

import functools
import math
import warnings
import weakref

import keras
import numpy as np
from keras import ops

from accum_model.core import arithmetic
from accum_model.core import checkpoint_layout as layout
from accum_model.core import window as core_window
from accum_model.core.lifecycle import WindowLifecycle
from accum_model.core.messages import window_is_open
from accum_model.core.variables import is_overwritten_with_gradient
from accum_model.keras3 import learning_rate
from accum_model.keras3.optimizer import Keras3LossScaling
from accum_model.keras3.saving import InKerasFiles
from accum_model.keras3.stateless_normalization import PooledStatistics
from accum_model.keras3.stateless_ops import KERAS_OPS


class StatelessAccumulation(WindowLifecycle):
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

    # The array operations of the window end's mean gradient.
    ops = KERAS_OPS
    # Whether a traced step runs both outcomes of the window's end and
    # selects one (see `_chosen`) rather than branching.
    selects_outcomes = False
    # The pooled BatchNormalization statistics of a model.
    Statistics = PooledStatistics
    # Whether the store holds each device's own gradient sums, reduced
    # across devices only as the window ends (`with_held_sums`).
    reduces_at_end = False

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

    def _window_value(self, name):
        return float(getattr(self.window.state, name))

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

    def with_held_sums(self, state, consume=False):
        """`state` with the window's gradient sums in it, where the backend
        holds them elsewhere (PyTorch's `.grad`); else `state` itself.
        `consume`: the window ends, and what holds the sums may be turned
        into them in place."""
        del consume
        return state

    def _sum_shape(self, variable):
        """The shape of the store's gradient sum of `variable`."""
        return tuple(variable.shape)

    def _placed(self, total, like, kept):
        """A saved window's gradient sum `total` (flat), as the store holds
        sums like `like` (`kept`: of a variable Keras overwrites)."""
        del kept
        return ops.cast(total.reshape(like.shape), like.dtype)

    def zero_sums(self):
        """Zero gradient sums the store holds already for the emptied
        window, or None to make them."""
        return None

    def optimizer_apply(self, optimizer_values, gradients, trainable):
        """The optimizer's update of `trainable` (values) by `gradients`:
        the new (trainable, optimizer) values."""
        return self.loss_scaling.optimizer.stateless_apply(
            optimizer_values, gradients, trainable)

    def _settled(self, ends):
        """Whether the window ends, as the step goes on with it: the
        traced value where both branches are traced (JAX), a Python bool
        where the step runs eagerly and a branch not taken costs its work."""
        return ends

    # What users read -------------------------------------------------------

    def micro_batch_share(self):
        """1/n inside the step (see `arithmetic.micro_batch_share`); 1.0
        outside it."""
        state = self._traced_window
        if state is None:
            return 1.0
        return arithmetic.micro_batch_share(
            state.length, state.micro_steps, state.steps_left_in_epoch, 1,
            KERAS_OPS, self.divide_by_weight, self.micro_batches_in_step)

    def opens_window(self):
        """Bool scalar: whether the micro step being run is its window's
        first (True outside the step)."""
        state = self._traced_window
        if state is None:
            return True
        return state.micro_steps == 0

    def accumulator_bytes(self):
        # Per device: a store that keeps one block per device holds one
        # variable's size of each sum on each.
        if self.window is None:
            return 0
        return sum(_elements(v) * np.dtype(
            keras.backend.standardize_dtype(s.dtype)).itemsize
                   for v, s in zip(self.window.trainable_variables,
                                   self.window.state.gradient_sums))

    # Set-up ----------------------------------------------------------------

    def set_up(self, loss_scaling, run_eagerly, report_loss=None,
               float16_gradients=None):
        del run_eagerly, report_loss  # The step logs the window's loss.
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
        self.float16_flags = (
            self._float16_gradients(variables)
            if self.loss_scaling is not None and self.loss_scaling.active
            and self._float16_gradients is not None
            else [False] * len(variables))
        # Where each layer's moving statistics sit among the non-trainable
        # variables follows which weights are trainable now.
        self.statistics = self.Statistics(model)
        if self.window is not None and self.window.matches(variables):
            return
        self.window = _Window(variables, core_window.empty_state(
            [self._sum_shape(v) for v in variables],
            self.settings.accumulator_dtype, self.overwrite,
            self.window_length(), KERAS_OPS, self._epoch_steps,
            statistics_sums=self.statistics.empty_sums()))
        self.follow_learning_rate_scale()
        self.checkpoint.window_built()

    def write_window(self, arrays):
        """Writes a saved window (`checkpoint_layout.read` arrays) into the
        window (eagerly). The open window keeps the length it was started
        with; the windows after it take this model's own length."""
        state = self.window.state
        gradients, _, counters = layout.window_to_write(
            arrays, [_elements(v) for v in self.window.trainable_variables],
            float(state.skipped_windows))
        self.window.state = core_window.restored(
            state, counters, KERAS_OPS)._replace(
            gradient_sums=[
                self._placed(value, total, kept) for value, total, kept
                in zip(gradients, state.gradient_sums, self.overwrite)],
            statistics_sums=[
                ops.cast(value, "float32")
                for value in layout.statistics_to_write(
                    arrays, [tuple(s.shape) for s in state.statistics_sums],
                    counters, self.statistics.names)],
        )
        self._set_window_length(self.window_length())

    # Training --------------------------------------------------------------

    def start_epoch(self, steps, epoch=None):
        self._start_epoch_counts(steps, epoch)
        if self.window is not None:
            self.window.state = core_window.with_epoch(
                self.window.state, self._epoch_steps, KERAS_OPS,
                new_epoch=epoch is not None)
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
        self.window.state = core_window.with_length(self.window.state,
                                                    length, KERAS_OPS)

    def window_config(self):
        """The `core.window.WindowConfig` of the window as set up now."""
        return core_window.WindowConfig(
            overwrite=tuple(self.overwrite),
            divide_by_weight=self.divide_by_weight,
            measure_noise_scale=self.settings.measure_noise_scale,
            has_gradient=(None if self.has_gradient is None
                          else tuple(self.has_gradient)),
            float16=tuple(self.float16_flags),
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
        state = self.window.state = self.with_held_sums(self.window.state,
                                                        consume=True)
        window_loss = core_window.loss(self.window_config(), state,
                                       KERAS_OPS)
        samples = state.sample_sum
        # The large batch's forward pass moves the moving statistics
        # whether or not its update is then skipped for overflow.
        self.statistics.move_variables(state.statistics_sums, model)
        variables = self.window.trainable_variables
        trainable, optimizer_values, self.window.state = self._apply_open[1](
            ([v.value for v in variables],
             [v.value for v in optimizer.variables], state))
        assign_values(variables, trainable)
        assign_values(optimizer.variables, optimizer_values)
        model._loss_tracker.update_state(window_loss, sample_weight=samples)


def assign_values(variables, values):
    """Writes `values` into `variables`, but where a value is already the
    variable's own (an optimizer applied in place)."""
    for variable, value in zip(variables, values):
        if value is not variable.value:
            variable.assign(value)


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
                    moments=None, counts=True, may_end=True):
    """Adds a micro-batch (and its normalization layers' `moments`) to the
    window and applies the window when it is due; returns the new
    (trainable, non-trainable, optimizer values, window), whether the
    window ended, its loss and its samples. `gradients` is None where the
    backend has already added them to the sums it holds itself
    (`with_held_sums`). A batch's micro-batches after its first
    (`micro_batch_size`) do not count as micro steps (`counts`), and the
    window may end only with its last (`may_end`)."""
    config = accumulation.window_config()
    if gradients is None:
        window = core_window.counters_added(config, window, None, weight,
                                            loss, samples, KERAS_OPS, counts)
    else:
        window = core_window.micro_batch_added(
            config, window, gradients, weight, loss, samples, KERAS_OPS,
            counts)
    if moments is not None:
        window = window._replace(
            statistics_sums=accumulation.statistics.micro_batch_added(
                window.statistics_sums, moments, non_trainable))
    ends = (accumulation._settled(core_window.ends(window)) if may_end
            else False)
    # Read only where the window ends (known here where the step runs
    # eagerly).
    window_loss = (None if ends is False
                   else core_window.loss(config, window, KERAS_OPS))
    window_samples = window.sample_sum
    if moments is not None:
        # Moved whether the update is applied or skipped for overflow, as
        # the large batch's forward pass moves them.
        non_trainable = accumulation.statistics.moved(
            window.statistics_sums, non_trainable, ends)
    operands = (list(trainable), optimizer_values, window)
    if isinstance(ends, bool):
        # Run eagerly: only the branch taken runs.
        trainable, optimizer_values, window = (
            end_window(accumulation, (operands[0], operands[1],
                                      accumulation.with_held_sums(
                                          window, consume=True)))
            if ends else operands)
    else:
        trainable, optimizer_values, window = _traced_end(
            accumulation, ends, operands)
    return (trainable, non_trainable, optimizer_values, window, ends,
            window_loss, window_samples)


def _traced_end(accumulation, ends, operands):
    """`end_window` where `ends` is traced. The conditional returns no
    gradient sums: the window keeps its sums as they are, read as zeros
    once it has no micro step (see `core.window.reset`), so the compiled
    step writes each sum once, in place."""
    trainable, optimizer_values, window = operands

    def without_sums(result):
        trainable, optimizer_values, window = result
        return (list(trainable), list(optimizer_values),
                window._replace(gradient_sums=[]))

    trainable, optimizer_values, emptied = _chosen(
        accumulation, ends,
        lambda: without_sums(end_window(accumulation, (
            trainable, optimizer_values,
            accumulation.with_held_sums(window, consume=True)))),
        lambda: without_sums(operands))
    return trainable, optimizer_values, emptied._replace(
        gradient_sums=window.gradient_sums)


def end_window(accumulation, operands):
    """Applies the window in `operands` (trainable values, optimizer
    values, `WindowState`) with the optimizer, or skips it when it
    overflowed; returns the three with the window emptied. The mean
    gradient is taken last of all that reads the sums: a backend may divide
    them in place (`ArrayOps.divide_all_no_nan`)."""
    trainable, optimizer_values, state = operands
    scaling = accumulation.loss_scaling
    config = accumulation.window_config()
    zero_sums = accumulation.zero_sums()

    def mean_gradients():
        return core_window.mean_gradients(
            config, state, [value.dtype for value in trainable],
            accumulation.ops)

    def apply(gradients):
        with learning_rate.scaled_by(scaling.optimizer,
                                     state.learning_rate_scale):
            return accumulation.optimizer_apply(
                optimizer_values, gradients, trainable)

    checks = core_window.end_checks(scaling.active, accumulation.settings)
    scale = (optimizer_values[scaling.scale_index()] if scaling.active
             else None)
    verdict = core_window.passes(checks, config, state, scale, KERAS_OPS)
    emptied = core_window.ended(config, state, KERAS_OPS, verdict,
                                zero_sums=zero_sums).next_state
    if scaling.active:
        # Keras's own LossScaleOptimizer unscales, checks, applies or
        # skips, and moves the scale, as after one large batch.
        # (Keras never scales what it overwrites with the "gradient".)
        trainable, optimizer_values = apply([
            g if overwrite or g is None
            else ops.where(verdict, g * ops.cast(scale, g.dtype),
                           float("inf"))
            for g, overwrite in zip(mean_gradients(), config.overwrite)])
        return list(trainable), list(optimizer_values), emptied

    def update():
        trainable, optimizer_values = apply(mean_gradients())
        return list(trainable), list(optimizer_values), emptied

    if verdict is True:
        return update()
    return _chosen(accumulation, verdict, update,
                   lambda: (trainable, optimizer_values, emptied))


def _chosen(accumulation, predicate, if_true, if_false):
    """`ops.cond(predicate, if_true, if_false)`; or, where the
    accumulation selects outcomes, both run and each value is taken from
    the one `predicate` picks. Keras's `LossScaleOptimizer` branches in its
    own apply: under it the window's end branches too, which runs that
    conditional once per window rather than in every micro step. So does
    a window whose store reduces its sums across devices as it ends."""
    if (not accumulation.selects_outcomes
            or accumulation.loss_scaling.active
            or accumulation.reduces_at_end):
        return ops.cond(predicate, if_true, if_false)
    return keras.tree.map_structure(
        lambda taken, other: (
            taken if taken is None else ops.where(predicate, taken, other)),
        if_true(), if_false())


class StatelessLossScaling(Keras3LossScaling):
    """The compiled optimizer's duties on JAX and PyTorch.

    The micro steps scale and unscale as on every Keras 3 backend. The
    window end hands the `LossScaleOptimizer` the window's mean gradient
    scaled by S again, or inf where the window overflowed (a non-finite
    sum, or a float16 weight gradient whose sum the large batch could not
    hold): its own `stateless_apply` then unscales and applies, or skips,
    and moves the scale, exactly as after one large batch.

    Args:
        optimizer: The compiled optimizer, a `LossScaleOptimizer` or not.
    """

    def scale_index(self):
        """Where S sits among the optimizer's variables."""
        lso = self.loss_scale_optimizer
        return next(i for i, v in enumerate(lso.variables)
                    if v is lso.dynamic_scale)


class StatelessWindowCheckpoint(InKerasFiles, layout.RestoredWindow):
    """The open window in Keras files, laid out as on TensorFlow
    (`core.checkpoint_layout`): a file saved on either backend restores on
    the other.

    Args:
        accumulation: The `Accumulation` whose window is saved.
    """

    def __init__(self, accumulation):
        layout.RestoredWindow.__init__(self)
        self._accumulation = weakref.ref(accumulation)

    def saved_state(self):
        """The window's arrays as a file holds them (`core.checkpoint_layout`),
        or None when there is no window to save."""
        accumulation = self._accumulation()
        if accumulation.window is None:
            return self._pending
        state = accumulation.with_held_sums(accumulation.window.state)
        return layout.saved_state(
            [ops.convert_to_numpy(s) for s in
             core_window.counted_gradient_sums(state, KERAS_OPS)],
            [True] * len(state.gradient_sums),
            {name: float(getattr(state, name)) for name in layout.COUNTERS},
            [ops.convert_to_numpy(s) for s in state.statistics_sums],
            self._accumulation().statistics.names,
        )

    def _window_exists(self):
        return self._accumulation().window is not None

    def _write(self, arrays):
        self._accumulation().write_window(arrays)
