"""BatchNormalization's moving statistics, pooled over a window on JAX and
PyTorch (what Keras does is in `normalization`).

In Keras's stateless call (JAX) the layer's assigns become the step's new
non-trainable values, which are put back as they were; PyTorch's stateful
call is kept from moving them by `torch_normalization`. The window sums
each micro-batch's moments (`core.arithmetic.statistics_terms`) and moves
the statistics once, when it ends (`pooled_moving_statistics`), whether
its update is applied or skipped for overflow, as the large batch's
forward pass would.

A layer called several times in one step pools each call apart and moves
once per call, in call order, as one step of the large batch would (and as
on TensorFlow). The state's shape is settled before the step is traced, so
the number of calls is read from the model's functional graph
(`calls_in_graph`); a layer the step calls a number of times the graph
does not show moves its own statistics on each micro-batch (warned once).
"""

import contextlib
import warnings

import keras

from keras import ops

from accum_model.core import arithmetic
from accum_model.core.class_tree import layers_of
from accum_model.keras3.stateless_ops import KERAS_OPS
from accum_model.keras3.normalization import is_symbolic_call
from accum_model.keras3.normalization import masked_element_counts
from accum_model.keras3.normalization import normalized_once_per_window
from accum_model.keras3.normalization import pools_moving_statistics
from accum_model.keras3.normalization import renormalizes_kernel
from accum_model.keras3.loop import calls_in_graph


class PooledStatistics:
    """The layers of a model whose moving statistics a window pools.

    Args:
        model: The built model.
    """

    def __init__(self, model):
        layers = layers_of(model)
        self.layers = [layer for layer in layers
                       if pools_moving_statistics(layer)]
        # The layers that renormalize their kernel once per window.
        self.renormalizing = [layer for layer in layers
                              if renormalizes_kernel(layer)]
        position = {id(v): i
                    for i, v in enumerate(model.non_trainable_variables)}
        self._positions = [
            (position[id(layer.moving_mean)],
             position[id(layer.moving_variance)])
            for layer in self.layers]
        graph = calls_in_graph(model)
        # Calls of each layer per step; its sums are `calls` consecutive
        # entries of the window's, from `self._first[i]`.
        self.calls = [graph.get(id(layer), 1) for layer in self.layers]
        self._first = [sum(self.calls[:i]) for i in range(len(self.layers))]
        # The layer name of each entry of the window's sums.
        self.names = [layer.name
                      for layer, calls in zip(self.layers, self.calls)
                      for _ in range(calls)]
        # Which layers the traced step called as often as expected (static).
        self.pooled = [True] * len(self.layers)
        self._warned = False

    @property
    def moving_positions(self):
        """The positions of the pooled layers' moving means and variances
        among the model's non-trainable variables."""
        return {index for pair in self._positions for index in pair}

    def empty_sums(self):
        """One float32 [3, channels] array of zeros per call of a layer."""
        return [ops.zeros([3, int(layer.moving_mean.shape[0])], "float32")
                for layer, calls in zip(self.layers, self.calls)
                for _ in range(calls)]

    @contextlib.contextmanager
    def recording(self, combined=None, spectral_writes=None):
        """Records each layer's training-mode moments in a forward pass.

        Args:
            combined: None, or where each device's pass sees its own share
                of the batch, a function `(count, mean, variance) ->
                (count, mean, variance)` that makes a call's moments the
                whole batch's: the layer normalizes by them, and records
                them.
            spectral_writes: None, or where the `renormalizing` layers
                renormalize once per window, when their writes land: the
                accumulation's `spectral_writes()`.

        Yields:
            A list with one list per layer, to which each call appends
            `(count, mean, variance)`, each float32 [channels].
        """
        records = [[] for _ in self.layers]
        for layer, calls in zip(self.layers, records):
            vars(layer)["_moments"] = _recording_moments(
                layer, calls, self.element_counts, combined)
        renormalizing = self.renormalizing if spectral_writes else []
        for layer in renormalizing:
            vars(layer)["normalized_weights"] = normalized_once_per_window(
                layer, *spectral_writes)
        try:
            yield records
        finally:
            for layer in self.layers:
                vars(layer).pop("_moments", None)
            for layer in renormalizing:
                vars(layer).pop("normalized_weights", None)

    def moments_of(self, records):
        """Each layer's recorded moments, a list with one
        `(count, mean, variance)` per call, or None where it is not pooled
        (not called in training, or called a number of times its graph does
        not show), from the records of the traced step; notes which layers
        are pooled."""
        self.pooled = [len(calls) == expected
                       for calls, expected in zip(records, self.calls)]
        unexpected = [f"{layer.name} (called {len(calls)} times, "
                      f"{expected} in its graph)"
                      for layer, calls, expected in zip(self.layers, records,
                                                        self.calls)
                      if calls and len(calls) != expected]
        if unexpected and not self._warned:
            self._warned = True
            warnings.warn(
                "BatchNormalization layers called a number of times their "
                "model's functional graph does not show move their moving "
                "statistics on each micro-batch on "
                f"{keras.backend.backend()}: {', '.join(unexpected)}. Call "
                "such a layer from a functional model (or train on "
                "TensorFlow, which pools every call).", stacklevel=2)
        return [[tuple(self.detached(value) for value in call)
                 for call in calls] if pooled else None
                for calls, pooled in zip(records, self.pooled)]

    def detached(self, value):
        """A recorded moment as the window reads it: out of the backward
        pass (a number as it is)."""
        return value if isinstance(value, float) else ops.stop_gradient(value)

    def element_counts(self, layer, inputs, mask):
        """Float32 [channels]: the elements each channel's moments cover
        (every element of the reduced axes, or those the mask leaves in)."""
        if mask is not None:
            return masked_element_counts(layer, inputs, mask)
        return ops.full([int(layer.moving_mean.shape[0])],
                        unmasked_count(layer, inputs), "float32")

    def keep_moving(self, new_values, old_values):
        """`new_values` (the step's non-trainable values) with each pooled
        layer's moving statistics as they were before the step."""
        new_values = list(new_values)
        for (mean_at, variance_at), pooled in zip(self._positions,
                                                  self.pooled):
            if pooled:
                new_values[mean_at] = old_values[mean_at]
                new_values[variance_at] = old_values[variance_at]
        return new_values

    def micro_batch_added(self, sums, moments, non_trainable):
        """The window's sums with a micro-batch's moments added."""
        added = list(sums)
        for first, recorded, (mean_at, _) in zip(self._first, moments,
                                                 self._positions):
            # Shifted by the moving mean the window started with (a
            # pooled layer's stays put until the window ends).
            shift = ops.cast(non_trainable[mean_at], "float32")
            for index, (count, mean, variance) in enumerate(recorded or (),
                                                            start=first):
                added[index] = added[index] + ops.stack(
                    arithmetic.statistics_terms(
                        count, ops.cast(mean, "float32"),
                        ops.cast(variance, "float32"), shift, KERAS_OPS))
        return added

    def moved(self, sums, non_trainable, ends=True):
        """`non_trainable` with each pooled layer's moving statistics moved
        once by the window's pooled moments, where `ends` (a traced bool, or
        a Python bool where the step runs eagerly)."""
        non_trainable = list(non_trainable)
        if ends is False:
            return non_trainable
        for layer, first, calls, (mean_at, variance_at), pooled in zip(
                self.layers, self._first, self.calls, self._positions,
                self.pooled):
            if not pooled:
                continue
            old_mean = non_trainable[mean_at]
            old_variance = non_trainable[variance_at]
            # The sums were shifted by the moving mean the window started
            # with, which is still the moving mean now; each call moves
            # from where the one before it left the statistics.
            shift = ops.cast(old_mean, "float32")
            mean, variance = shift, ops.cast(old_variance, "float32")
            for total in sums[first:first + calls]:
                mean, variance = arithmetic.pooled_moving_statistics(
                    total[0], total[1], total[2], shift, mean, variance,
                    float(layer.momentum), KERAS_OPS)
            mean = ops.cast(mean, old_mean.dtype)
            variance = ops.cast(variance, old_variance.dtype)
            if ends is not True:
                mean = ops.where(ends, mean, old_mean)
                variance = ops.where(ends, variance, old_variance)
            non_trainable[mean_at] = mean
            non_trainable[variance_at] = variance
        return non_trainable

    def move_variables(self, sums, model):
        """Moves the layers' moving statistics by the window's (eagerly)."""
        variables = model.non_trainable_variables
        moved = self.moved(sums, [v.value for v in variables])
        for (mean_at, variance_at), pooled in zip(self._positions,
                                                  self.pooled):
            if pooled:
                variables[mean_at].assign(moved[mean_at])
                variables[variance_at].assign(moved[variance_at])


def unmasked_count(layer, inputs):
    """Int: the elements each channel's moments cover without a mask."""
    count = 1
    for axis in layer._reduction_axes:
        count *= inputs.shape[axis]
    return count


def _recording_moments(layer, calls, element_counts, combined):
    """`layer._moments` that appends what it returns, with
    `element_counts(layer, inputs, mask)`, to `calls` (each made the whole
    batch's by `combined`, where given)."""
    original = type(layer)._moments.__get__(layer)

    def moments(inputs, mask):
        mean, variance = original(inputs, mask)
        if is_symbolic_call():
            return mean, variance
        count = element_counts(layer, inputs, mask)
        if combined is not None:
            count, mean, variance = combined(count, mean, variance)
        calls.append((count, mean, variance))
        return mean, variance

    return moments
