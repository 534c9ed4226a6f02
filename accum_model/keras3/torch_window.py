"""Keras 3 on PyTorch: the store of the window, run eagerly.

`TorchAccumulation` runs `stateless_window`'s window on the variables'
values, one micro step at a time (the step is `torch_adapter`'s). Where it
can, the window's gradient sums live in the variables' `.grad`, which each
micro step's `loss.backward()` adds into and only the window's end empties;
see `torch_adapter` for where they move into the window's state instead.
Checked on keras 3.15.1 with torch 2.13.0 (`Variable.value` and its
`.grad`).
"""

import keras
import torch
from keras import ops

from accum_model.core import class_tree
from accum_model.core.update_signal import UpdateSignal
from accum_model.keras3 import stateless_window
from accum_model.keras3.stateless_ops import KERAS_OPS
from accum_model.keras3.torch_normalization import TorchPooledStatistics


def _divide_all_no_nan(arrays, denominator):
    # In place: the window's sums are read for the last time here, so its
    # mean takes no second copy of the weights.
    if not arrays:
        return []
    if bool(denominator == 0):  # A window whose every element is masked.
        torch._foreach_zero_(arrays)
    else:
        torch._foreach_div_(arrays, denominator)
    return list(arrays)


class TorchAccumulation(stateless_window.StatelessAccumulation):
    """`stateless_window.StatelessAccumulation` on PyTorch: the window's
    state is held here and moved eagerly by each step.

    Args:
        settings: The `Settings` to accumulate with.
    """

    ops = KERAS_OPS._replace(divide_all_no_nan=_divide_all_no_nan)
    Statistics = TorchPooledStatistics

    def __init__(self, settings):
        super().__init__(settings)
        # The optimizer's count, copied before each run; read only when
        # asked (reading it then would wait for the device every step).
        self.update_signal = UpdateSignal(
            lambda optimizer: optimizer.iterations.value, torch.clone)
        # Whether the built-in step (which knows the loss) fed the window.
        self.tracks_loss = True
        # Where the open window's gradient sums are: "grads" (the
        # variables' `.grad`, over the first micro-batch's weight
        # `_grads_weight` and times the loss scale and the micro-batch
        # share `_grads_share`), "state", or None while it is empty.
        self._sums_in = None
        self._grads_weight = None
        self._grads_share = None
        # The state's gradient sums while `.grad` holds the window: zeros.
        self._zero_sums = None
        # A weight whose `.grad` holds the open window (see `watch_grads`).
        self._watched_grad = None
        # Whether `.grad` can hold this window's sums (set when the window
        # is built).
        self._grads_can_hold = False

    def build_window(self, model):
        super().build_window(model)
        settings = self.settings
        self._grads_can_hold = (
            not settings.measure_noise_scale and not any(self.overwrite)
            and all(keras.backend.standardize_dtype(v.dtype)
                    == settings.accumulator_dtype
                    for v in self.window.trainable_variables))

    def sums_in_grads(self, model):
        """Whether this micro step's gradients go into the sums `.grad`
        holds; where the window is empty, opens it there if it can."""
        watched = self._watched_grad
        if watched is not None and watched.grad is None:
            raise RuntimeError(
                "The gradients of an open window were cleared between its "
                "micro steps (`zero_grad()`, or `.grad` set to None, on the "
                "model's weights outside its training step): on PyTorch an "
                "AccumulatingModel keeps the window's gradient sums in "
                "`.grad` until the window ends. Call `apply_open_window()` "
                "before touching the weights' gradients. Received: a "
                f"window of {self.open_micro_steps()} micro steps without "
                "its sums")
        if self._sums_in is None:
            model_class = type(model)
            base = class_tree.accumulating_base(model_class)
            keeps_scaling = all(
                getattr(model_class, name) is getattr(base, name)
                for name in ("get_scaled_loss", "get_unscaled_gradients"))
            if self._grads_can_hold and keeps_scaling:
                model.zero_grad()
                self._sums_in = "grads"
            else:
                self._sums_in = "state"
        return self._sums_in == "grads"

    def scaled_for_grads(self, loss, weight):
        """The loss to differentiate into `.grad`: the micro-batch's loss
        times its weight relative to the window's first micro-batch's,
        scaled as `get_scaled_loss` scales with the share of the window's
        first micro-batch, kept for the window. Relative, so that each
        sample's term in the backward pass stays what `get_scaled_loss`
        makes it: the large batch's, where float16 overflows as the large
        batch does."""
        if self._grads_weight is None:
            self._grads_weight = ops.where(weight > 0, weight, 1.0)
        if self.loss_scaling.active and self._grads_share is None:
            # Kept for the window: the window end unscales its sums by one
            # share, and batches split into different numbers of
            # micro-batches (`micro_batch_size`) give theirs different ones.
            self._grads_share = self.micro_batch_share()
        return self.loss_scaling.scale_loss(
            loss * (weight / self._grads_weight), self._grads_share)

    def watch_grads(self):
        """After a micro step's backward pass: notes a weight whose `.grad`
        holds the window, to notice it cleared before the next."""
        if self._sums_in == "grads" and self._watched_grad is None:
            self._watched_grad = next(
                (v.value for v in self.window.trainable_variables
                 if v.value.grad is not None), None)

    def optimizer_apply(self, optimizer_values, gradients, trainable):
        # In place, as Keras's own step applies (its PyTorch optimizers
        # update every variable in a few `torch._foreach_*` operations):
        # the values handed in are the variables' own.
        del optimizer_values, trainable
        optimizer = self.loss_scaling.optimizer
        variables = self.window.trainable_variables
        optimizer.apply(gradients, variables)
        return ([v.value for v in variables],
                [v.value for v in optimizer.variables])

    def zero_sums(self):
        # A window in `.grad` leaves the state's own sums at zero.
        return self._zero_sums if self._sums_in == "grads" else None

    def with_held_sums(self, state, consume=False):
        if self._sums_in != "grads":
            return state
        self._zero_sums = state.gradient_sums
        variables = self.window.trainable_variables
        grads = [v.value.grad for v in variables]
        # A variable no micro-batch of the window reached has no `.grad`.
        self.has_gradient = [g is not None for g in grads]
        factor = self._grads_weight
        if self.loss_scaling.active:
            factor = factor / (self.loss_scaling.current_scale()
                               * self._grads_share)
        present = [g for g in grads if g is not None]
        if consume and present:
            # `.grad` becomes the sums: no second copy of the weights.
            torch._foreach_mul_(present, factor)
            sums = iter(present)
        else:
            sums = iter(torch._foreach_mul(present, factor) if present
                        else ())
        return state._replace(gradient_sums=[
            ops.zeros_like(v.value) if g is None else next(sums)
            for g, v in zip(grads, variables)])

    def _move_sums_to_state(self):
        """Moves sums `.grad` holds into the window's state."""
        if self._sums_in == "grads":
            self.window.state = self.with_held_sums(self.window.state,
                                                    consume=True)
            self._empty_grads()
        self._sums_in = "state"

    def _empty_grads(self):
        self._watched_grad = None
        for variable in self.window.trainable_variables:
            variable.value.grad = None

    def _tracks_loss(self):
        return self.tracks_loss

    def add_micro_batch(self, model, gradients, weight, loss, samples,
                        moments=None, counts=True, may_end=True):
        """Adds a micro-batch's unscaled gradients to the window and applies
        it when due, writing the new values into the variables; returns
        whether the window ended, its loss and its samples (`counts` and
        `may_end`: see `stateless_window.add_micro_batch`)."""
        window = self.window
        variables = window.trainable_variables
        if gradients is not None:
            gradients = self._with_zeros_for_missing(gradients, variables)
        optimizer_variables = self.loss_scaling.optimizer.variables
        non_trainable = None
        if moments is not None:
            non_trainable = [v.value for v in model.non_trainable_variables]
        with torch.no_grad():
            (trainable, new_non_trainable, optimizer_values, window.state,
             ends, window_loss, window_samples) = (
                stateless_window.add_micro_batch(
                    self, [v.value for v in variables],
                    [v.value for v in optimizer_variables], window.state,
                    gradients, weight, loss, samples, non_trainable,
                    moments, counts, may_end))
            if ends:
                # Only a window's end changes these.
                stateless_window.assign_values(variables, trainable)
                stateless_window.assign_values(optimizer_variables,
                                               optimizer_values)
            if moments is not None:
                for variable, old, new in zip(model.non_trainable_variables,
                                              non_trainable,
                                              new_non_trainable):
                    if new is not old:
                        variable.assign(new)
        if ends:
            self._window_ended()
        return ends, window_loss, window_samples

    def _settled(self, ends):
        # One read of the device per micro step: a step that does not end
        # the window then skips the window end and the statistics' move.
        return bool(ends)

    def _with_zeros_for_missing(self, gradients, variables):
        """The gradients, with zeros where a variable has none (the window
        holds one sum per variable); notes which variables had one."""
        if self.has_gradient is None or len(self.has_gradient) != len(
                variables):
            self.has_gradient = [False] * len(variables)
        self.has_gradient = [used or g is not None for used, g in zip(
            self.has_gradient, gradients)]
        return [ops.zeros_like(v.value) if g is None else g
                for g, v in zip(gradients, variables)]

    def _window_ended(self):
        self.has_gradient = None
        if self._sums_in == "grads":
            self._empty_grads()
        self._sums_in = None
        self._grads_weight = None
        self._grads_share = None

    def apply_open_window(self):
        super().apply_open_window()
        self._window_ended()

    def write_window(self, arrays):
        if self._sums_in == "grads":
            self._empty_grads()
        super().write_window(arrays)
        # A restored window's sums may hold a gradient of any variable.
        self.has_gradient = [True] * len(self.window.trainable_variables)
        self._sums_in = "state" if self.open_micro_steps() else None
        self._grads_weight = None
