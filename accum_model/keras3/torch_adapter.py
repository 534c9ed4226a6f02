"""Keras 3 on PyTorch: the window in Keras's eager training step.

Keras's torch trainer (`keras/src/backend/torch/trainer.py`) runs
`train_step(data)` eagerly: a stateful forward pass, `loss.backward()`,
then `optimizer.apply` on the variables. The accumulating step keeps the
first two and hands the gradients, times what Keras divided the loss by,
to the window of `stateless_window`, the same window JAX runs in its
jitted step: it runs here eagerly on the variables' values
(`torch_window.TorchAccumulation`), and applies
the window with the optimizer's own `apply` (in place, as Keras's step
does) when it is full or the epoch ends.

Where it can, the window's gradient sums live in the variables' `.grad`:
each micro step differentiates its loss times its weight, and
`loss.backward()` adds that into `.grad`, which is emptied only when the
window ends; a micro step then costs the window a few scalar operations
rather than several per variable. The sums move into the window's state
where `.grad` cannot hold them: a noise scale to measure, a variable Keras
overwrites, accumulators of another dtype than the variables, a model with
its own `get_scaled_loss` or `get_unscaled_gradients`, a window restored
open or fed by `accumulate_gradients`. Between the micro steps of an open
window, `.grad` holds the window: code that calls `backward()` or
`zero_grad()` on the model's weights then changes it.

BatchNormalization layers' moving statistics are pooled over the window:
the forward pass records their moments without moving them
(`torch_normalization`), until the window moves them once.

Not on PyTorch (each refused by name before training): `jit_compile=True`
(`torch.compile` of the step), several processes (`torch.distributed`:
Keras 3 has no data-parallel `fit()` on PyTorch), and
`stateless_accumulate_gradients` (a step of the user's own calls
`accumulate_gradients`, as on TensorFlow).

Private Keras members used, checked on keras 3.15.1 with torch 2.13.0:
`_compute_loss`, `_call_has_training_arg`, `_loss_tracker`, `zero_grad`,
`jit_compile`, `Variable.value` (and its `.grad`).
"""


import keras
import torch
from keras import ops

from accum_model.core import divisor
from accum_model.core import micro_step
from accum_model.keras3 import losses
from accum_model.keras3.stateless_ops import KERAS_SHAPES
from accum_model.keras3.stateless_adapter import StatelessAdapter
from accum_model.keras3.torch_window import TorchAccumulation


def micro_batches_step(model, data):
    """One step on PyTorch whose batch is split into micro-batches of at
    most `micro_batch_size` samples (`core.micro_step`), run one after
    another; returns the last one's logs."""
    accumulation = model._accumulation
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    batch_size = int(divisor.batch_size(x, KERAS_SHAPES))
    micro_batch_size = accumulation.micro_batch_size_for(
        tuple(tuple(leaf.shape) for leaf in keras.tree.flatten(data)
              if leaf is not None),
        batch_size, lambda size: passes_fit(model, x, size),
        "the largest tried without an out-of-memory error")
    bounds = micro_step.micro_batch_bounds(batch_size, micro_batch_size)
    accumulation.micro_batches_in_step = len(bounds)
    try:
        for index, (start, stop) in enumerate(bounds):
            logs = train_step(
                model, keras.tree.map_structure(
                    lambda value: value if ops.ndim(value) == 0
                    else value[start:stop], data),
                counts=index == 0, may_end=index == len(bounds) - 1)
    finally:
        accumulation.micro_batches_in_step = 1
    return logs


def passes_fit(model, x, size):
    """Whether a forward and backward pass on the first `size` samples of
    `x` runs without PyTorch's out-of-memory error. Leaves the model as it
    was: its non-trainable variables (moving statistics, seeds) are put
    back, and the gradients are taken apart from `.grad`."""
    saved = [variable.value.detach().clone()
             for variable in model.non_trainable_variables]
    rows = keras.tree.map_structure(
        lambda value: value if ops.ndim(value) == 0 else value[:size], x)
    try:
        with torch.enable_grad():
            y_pred = (model(rows, training=True)
                      if model._call_has_training_arg else model(rows))
            total = sum(torch.sum(ops.cast(value, "float32"))
                        for value in keras.tree.flatten(y_pred))
            weights = [variable.value
                       for variable in model.trainable_variables]
            if total.requires_grad and weights:
                torch.autograd.grad(total, weights, allow_unused=True)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        with torch.no_grad():
            for variable, value in zip(model.non_trainable_variables,
                                       saved):
                variable.value.copy_(value)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def train_step(model, data, counts=True, may_end=True):
    """One micro step on PyTorch (eager): Keras's forward and backward
    pass, then the window instead of the optimizer. (`counts` and
    `may_end`: see `stateless_window.add_micro_batch`.)"""
    accumulation = model._accumulation
    window = accumulation.window
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    statistics = accumulation.statistics
    accumulation._traced_window = window.state
    with statistics.recording(
            spectral_writes=accumulation.spectral_writes()) as records:
        if model._call_has_training_arg:
            y_pred = model(x, training=True)
        else:
            y_pred = model(x)
    moments = statistics.moments_of(records)
    statistics.move_unpooled(model)
    in_grads = accumulation.sums_in_grads(model)
    if not in_grads:
        model.zero_grad()
    # This micro-batch's own mean loss; the window divides by its whole
    # weight.
    with losses.losses_not_divided_by_replicas(), \
            losses.recording_loss_reductions(KERAS_SHAPES) as reductions:
        loss = model._compute_loss(x=x, y=y, y_pred=y_pred,
                                   sample_weight=sample_weight, training=True)
    accumulation.divide_by_weight = micro_step.loss_reduced(
        model, reductions, y_pred, losses.get_keras_mask, KERAS_SHAPES)
    weight = ops.cast(model.micro_batch_weight(x, y, y_pred, sample_weight),
                      "float32")
    accumulation.tracks_loss = True
    variables = window.trainable_variables
    weight = ops.stop_gradient(weight)
    gradients = None
    if in_grads:
        if variables:
            accumulation.scaled_for_grads(loss, weight).backward()
            accumulation.watch_grads()
    else:
        if variables:
            model.get_scaled_loss(loss).backward()
        gradients = model.get_unscaled_gradients(
            [v.value.grad for v in variables])
    samples = ops.cast(divisor.batch_size(x, KERAS_SHAPES), "float32")
    ends, window_loss, window_samples = accumulation.add_micro_batch(
        model, gradients, weight, ops.stop_gradient(loss), samples,
        moments if statistics.layers else None, counts, may_end)
    accumulation._traced_window = None
    # The loss in the logs is each window's, logged when it ends, weighted
    # by its samples as Keras weighs a batch's.
    if ends:
        model._loss_tracker.update_state(window_loss,
                                         sample_weight=window_samples)
    return micro_step.logged(
        model.compute_metrics(x, y, y_pred, sample_weight),
        lambda: window.state.skipped_windows,
        accumulation.loss_scaling.active, accumulation.settings)


class TorchModelDifferences:
    """What the Keras 3 `AccumulatingModel` does on PyTorch: its window is
    built before the first step, and the step runs uncompiled."""

    def make_train_function(self, force=False):
        accumulation = self._accumulation
        if accumulation.accumulates and (force or self.train_function is None):
            if self.jit_compile:
                raise ValueError(
                    "AccumulatingModel on PyTorch runs its training step "
                    "eagerly: torch.compile of the step (`jit_compile=True`) "
                    "is not supported. Compile with jit_compile=False (the "
                    "default on PyTorch). Received: jit_compile=True")
            accumulation.build_window(self)
        return super().make_train_function(force)


class TorchAdapter(StatelessAdapter):
    """Keras 3 on PyTorch: the window in Keras's eager step."""

    Accumulation = TorchAccumulation
    ModelDifferences = TorchModelDifferences

    @staticmethod
    def accumulating_train_step(model, data):
        if model._accumulation.settings.micro_batch_size is not None:
            return micro_batches_step(model, data)
        return train_step(model, data)

    @staticmethod
    def check_strategy(model):
        """Refuses several PyTorch processes: Keras 3's `fit()` on PyTorch
        trains on one device, and a window per process would never meet."""
        del model
        distributed = torch.distributed
        if (distributed.is_available() and distributed.is_initialized()
                and distributed.get_world_size() > 1):
            raise ValueError(
                "AccumulatingModel on PyTorch trains in one process on one "
                "device: Keras 3 has no data-parallel fit() on PyTorch, and "
                "windows in several processes would be applied apart. Train "
                "in one process, or use the TensorFlow or JAX backend for "
                "several devices. Received: torch.distributed world size "
                f"{distributed.get_world_size()}")

    @staticmethod
    def accumulate_gradients(model, gradients, weight, batch_size=None):
        """`AccumulatingModel.accumulate_gradients` on PyTorch (eager)."""
        accumulation = model._accumulation
        window = accumulation.window
        gradients = list(gradients)
        if len(gradients) != len(window.trainable_variables):
            raise ValueError(
                "Expected one gradient per trainable variable "
                f"({len(window.trainable_variables)}). Received: "
                f"{len(gradients)} gradients")
        weight = ops.stop_gradient(ops.cast(weight, "float32"))
        samples = (weight if batch_size is None
                   else ops.cast(batch_size, "float32"))
        accumulation.divide_by_weight = True
        accumulation.tracks_loss = False
        accumulation._move_sums_to_state()
        accumulation.add_micro_batch(
            model, [None if g is None else ops.stop_gradient(g)
                    for g in gradients],
            weight, ops.zeros((), "float32"), samples)
