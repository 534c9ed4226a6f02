"""BatchNormalization's moving statistics, taken over for a window on
TensorFlow (what Keras does is in `normalization`): during a micro step's
forward pass the layer's two assigns are suppressed and its moments
recorded, and the window moves the statistics once, from its pooled
moments (`accum_model.tensorflow.batch_statistics`).
"""

import contextlib
import threading

import tensorflow as tf

from accum_model.keras3.normalization import is_symbolic_call
from accum_model.keras3.normalization import masked_element_counts
from accum_model.keras3.normalization import normalized_once_per_window
from accum_model.keras3.normalization import pools_moving_statistics
from accum_model.keras3.normalization import renormalizes_kernel
from accum_model.tensorflow.batch_statistics import RecordedStatistics
from accum_model.tensorflow.batch_statistics import StatisticsCall



@contextlib.contextmanager
def recording_batch_statistics(layers, spectral_writes=None):
    """Records the moments of `layers`' training calls; suppresses updates.

    Only calls made by the thread that entered the block are recorded and
    suppressed: MirroredStrategy traces each replica's step in a thread of
    its own, and their blocks overlap.

    Args:
        layers: The model's layers (`layers_of`); those that
            `pools_moving_statistics` are taken over.
        spectral_writes: None, or where layers that `renormalizes_kernel`
            renormalize once per window, when their writes land: the
            accumulation's `spectral_writes()`.

    Yields:
        A list that each training-mode call of such a layer appends its
        `RecordedStatistics` to, in call order.
    """
    recorder = _Recorder()
    pooled = [layer for layer in layers if pools_moving_statistics(layer)]
    outer = getattr(_thread, "recorder", None)
    _thread.recorder = recorder
    try:
        for layer in pooled:
            recorder.hold(layer, "_moments", _recording_moments(layer))
        for layer in layers:
            if spectral_writes is not None and renormalizes_kernel(layer):
                recorder.hold(layer, "normalized_weights",
                              normalized_once_per_window(
                                  layer, *spectral_writes))
        yield recorder.records
    finally:
        _thread.recorder = outer
        for obj, name in recorder.held:
            _release(obj, name)


class _Recorder:
    """What one block records, and the attributes it holds replaced."""

    def __init__(self):
        self.records = []
        self.held = []
        self._held_keys = set()

    def hold(self, obj, name, value):
        """Replaces `obj.name` by `value` until the block ends (once)."""
        key = (id(obj), name)
        if key not in self._held_keys:
            self._held_keys.add(key)
            _hold(obj, name, value)
            self.held.append((obj, name))


_thread = threading.local()


def expected_statistics_calls(layers):
    """The calls a training step of `layers`' model is expected to make of
    the layers whose statistics it pools: one per trainable such layer, in
    the order of `layers`. The traced step replaces them by what it finds
    where they differ."""
    return [StatisticsCall(layer.moving_mean, layer.moving_variance,
                           layer.momentum, layer.name)
            for layer in layers
            if pools_moving_statistics(layer) and layer.trainable]


def _recording_moments(layer):
    """`layer._moments` that records what it returns for this thread."""
    original = type(layer)._moments.__get__(layer)

    def moments(inputs, mask):
        mean, variance = original(inputs, mask)
        recorder = getattr(_thread, "recorder", None)
        if recorder is None or is_symbolic_call():
            return mean, variance
        for variable in (layer.moving_mean, layer.moving_variance):
            # The layer assigns both right after: for this thread, nothing.
            recorder.hold(variable, "assign",
                          _assign_unless_recording(variable))
        call = StatisticsCall(layer.moving_mean, layer.moving_variance,
                              layer.momentum, layer.name)
        recorder.records.append(RecordedStatistics(
            call, _element_counts(layer, inputs, mask), mean, variance
        ))
        return mean, variance

    return moments


def _assign_unless_recording(variable):
    """`variable.assign` that does nothing where a recording block is open."""
    original = type(variable).assign.__get__(variable)

    def assign(value, *args, **kwargs):
        if getattr(_thread, "recorder", None) is not None:
            return None
        return original(value, *args, **kwargs)

    return assign


def _element_counts(layer, inputs, mask):
    """Float32, the elements each channel's moments cover: a scalar for
    every channel, or [channels] under a mask (`masked_element_counts`).

    Under `synchronized=True` the moments are the global batch's and the
    count this replica's: summed over replicas, each replica's share weighs
    the same global moments.
    """
    if mask is not None:
        return masked_element_counts(layer, inputs, mask)
    # The reduced axes hold every element but the channels'.
    channels = int(layer.moving_mean.shape[0])
    if inputs.shape.is_fully_defined():
        return tf.constant(inputs.shape.num_elements() // channels,
                           tf.float32)
    return tf.cast(tf.size(inputs, out_type=tf.int64) // channels,
                   tf.float32)


# Attributes replaced in objects' own dicts (writing the dict keeps Keras's
# attribute tracking out of it), counted by the blocks holding them, so that
# overlapping blocks of several threads put the original back exactly once.
_lock = threading.Lock()
_replaced = {}
_MISSING = object()


def _hold(obj, name, value):
    with _lock:
        key = (id(obj), name)
        entry = _replaced.get(key)
        if entry is not None:
            entry["holders"] += 1
            return
        attributes = vars(obj)
        _replaced[key] = {"saved": attributes.get(name, _MISSING),
                          "holders": 1}
        attributes[name] = value


def _release(obj, name):
    with _lock:
        key = (id(obj), name)
        entry = _replaced[key]
        entry["holders"] -= 1
        if entry["holders"]:
            return
        del _replaced[key]
        attributes = vars(obj)
        if entry["saved"] is _MISSING:
            attributes.pop(name, None)
        else:
            attributes[name] = entry["saved"]
