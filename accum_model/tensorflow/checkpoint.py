"""The open window in every checkpoint of the model.

A checkpoint taken between two updates holds the weights and optimizer state
of the last update; without the window, the micro-batches seen since then
would be lost on resume. `WindowCheckpoint` is an attribute of the model that
TensorFlow checkpoints carry (see `SavedInTfCheckpoints`); each Keras
adapter's `WindowCheckpoint` adds the Keras file formats that can carry it.
It saves the window as the whole window: accumulators and weight sums
summed over replicas, counters as they are.

Restoring writes each replica an equal share of the sums, so that they add up
to what was saved whatever the number of replicas or workers (the window end
needs only the total). A window restored before the model has built its
window (the usual build, compile, `load_weights` order) waits and is written
into the window when training builds it.
"""

import warnings
import weakref

import numpy as np
import tensorflow as tf

from accum_model.tensorflow import replicas
from accum_model.tensorflow.tf_checkpoint import SavedInTfCheckpoints

# Counters saved with the window, in the order of the "counters" array. The
# windows after the open one take the loading model's length, so only the
# open window's own length is saved.
_COUNTERS = ("weight_sum", "sample_sum", "micro_steps", "skipped_windows",
             "length", "loss_sum")
# Counters summed over replicas (the others are equal on every replica).
_SUMMED = ("weight_sum", "sample_sum", "loss_sum")


class WindowCheckpoint(SavedInTfCheckpoints):
    """Saves and restores the window of an `Accumulation`.

    Args:
        accumulation: The `Accumulation` whose window is saved.
    """

    def __init__(self, accumulation):
        self._accumulation = weakref.ref(accumulation)
        # A restored window waiting for the model to build its own.
        self._pending = None
        # Micro steps of the window the last restore wrote (or holds).
        self.restored_micro_steps = 0

    def _window(self):
        accumulation = self._accumulation()
        return None if accumulation is None else accumulation.window

    def has_state(self):
        return self._window() is not None or self._pending is not None

    def saved_state(self):
        """The window as arrays: the same keys whether or not it exists."""
        window = self._window()
        if window is None:
            return self._pending or _empty_state()
        # Read in cross-replica context: synchronised-on-read sums come back
        # summed over replicas (and workers), counters as the first replica's.
        # Narrow accumulators are saved as float32 (what every file format
        # holds); float64 ones as they are.
        saved_dtype = (
            tf.float64 if any(s.dtype == tf.float64
                              for s in window.gradient_sums)
            else tf.float32
        )
        sums = [tf.reshape(tf.cast(s.read_value(), saved_dtype), [-1])
                for s in window.gradient_sums]
        return {
            "gradients": (
                tf.concat(sums, 0).numpy() if sums
                else np.zeros([0], np.float32)
            ),
            "sizes": np.array(
                [int(s.shape.num_elements()) for s in window.gradient_sums],
                np.int64,
            ),
            "has_gradient": np.array(window.has_gradient, np.int8),
            "counters": np.array(
                [getattr(window, name).read_value().numpy()
                 for name in _COUNTERS],
                np.float64,
            ),
            # The pooled batch statistics of normalization layers.
            "statistics": (
                tf.concat([tf.reshape(s.read_value(), [-1])
                           for s in window.statistics.sums], 0).numpy()
                if window.statistics.sums else np.zeros([0], np.float32)
            ),
        }

    def restore_state(self, arrays):
        """Restores the window saved as `arrays` (empty: no window open)."""
        if "sizes" not in arrays:
            # A file saved without a window (by a model that never trained,
            # or by a plain `keras.Model`): restore an empty window.
            arrays = _empty_state()
        arrays = {key: np.asarray(value) for key, value in arrays.items()}
        # A window saved before the loss sum was kept: it logs no loss so far.
        counters = arrays["counters"]
        arrays["counters"] = np.concatenate(
            [counters, np.zeros([len(_COUNTERS) - len(counters)])]
        )
        self.restored_micro_steps = int(
            arrays["counters"][_COUNTERS.index("micro_steps")]
        )
        window = self._window()
        if window is None:
            self._pending = arrays
            return
        self._pending = None
        _write(window, arrays, self._accumulation())

    def window_built(self, window):
        """Writes a restored window into the window the model just built."""
        if self._pending is not None:
            arrays, self._pending = self._pending, None
            _write(window, arrays, self._accumulation())

    def pending_count(self, name):
        """A counter of the restored window not yet written, else 0.

        Args:
            name: "micro_steps" or "skipped_windows".
        """
        if self._pending is None:
            return 0
        return int(self._pending["counters"][_COUNTERS.index(name)])


def _empty_state():
    return {
        "gradients": np.zeros([0], np.float32),
        "sizes": np.zeros([0], np.int64),
        "has_gradient": np.zeros([0], np.int8),
        "counters": np.zeros([len(_COUNTERS)], np.float64),
        "statistics": np.zeros([0], np.float32),
    }


def _write(window, arrays, accumulation):
    """Writes `arrays` into `window` (eagerly, cross-replica context).

    The open window keeps the length it was started with; the windows after
    it take the model's own length, which may differ from the saving
    model's.
    """
    strategy = window.strategy
    sizes = [int(s.shape.num_elements()) for s in window.gradient_sums]
    saved_sizes = [int(n) for n in arrays["sizes"]]
    counters = dict(zip(_COUNTERS, arrays["counters"].tolist()))
    if not saved_sizes:
        # No window was saved: nothing is open (its length is set below);
        # the window keeps its count of skipped windows.
        counters["skipped_windows"] = float(
            window.skipped_windows.read_value().numpy()
        )
        saved_sizes = sizes
        gradients = np.zeros([sum(sizes)], np.float32)
        has_gradient = [False] * len(sizes)
    else:
        gradients = arrays["gradients"]
        has_gradient = [bool(h) for h in arrays["has_gradient"]]
    if saved_sizes != sizes:
        raise ValueError(
            "The checkpoint holds a gradient window for trainable weights of "
            f"sizes {saved_sizes}, but the model's trainable weights have "
            f"sizes {sizes}. Load it into a model with the same trainable "
            "weights, or call `model.apply_open_window()` before saving."
        )
    statistics = _statistics_to_write(window, arrays, counters)
    num_replicas = strategy.num_replicas_in_sync
    offsets = np.cumsum([0] + sizes)
    with strategy.scope():
        for i, gradient_sum in enumerate(window.gradient_sums):
            value = gradients[offsets[i]:offsets[i + 1]].reshape(
                gradient_sum.shape
            )
            replicas.assign_on_every_replica(gradient_sum,
                                             value / num_replicas)
        for name in _COUNTERS:
            share = (counters[name] / num_replicas if name in _SUMMED
                     else counters[name])
            replicas.assign_on_every_replica(getattr(window, name), share)
        for sums, value in zip(window.statistics.sums, statistics):
            replicas.assign_on_every_replica(sums, value / num_replicas)
        if window.noise is not None:
            window.noise.window_restored(is_open=counters["micro_steps"] > 0)
    window.has_gradient = [
        now or saved for now, saved in zip(window.has_gradient, has_gradient)
    ]
    window.set_length(accumulation.window_length())


def _statistics_to_write(window, arrays, counters):
    """The saved batch statistics, one array per call of the window.

    A window saved without them (by a model whose normalization layers moved
    their own statistics) has nothing pooled yet: zeros, and a warning when
    it holds micro-batches whose statistics the window then misses.
    """
    shapes = [tuple(s.shape) for s in window.statistics.sums]
    saved = np.asarray(arrays.get("statistics", np.zeros([0])))
    expected = sum(int(np.prod(shape)) for shape in shapes)
    if saved.size == 0 or not counters["micro_steps"]:
        if expected and counters["micro_steps"]:
            warnings.warn(
                "The checkpoint's open window holds "
                f"{int(counters['micro_steps'])} micro-batches but no "
                "BatchNormalization statistics for them (it was saved by a "
                "model whose layers moved their own): this window's moving "
                "statistics come from the micro-batches after the resume "
                "only. Call `model.apply_open_window()` before saving to "
                "keep every window whole.",
                stacklevel=2,
            )
        return [np.zeros(shape, np.float32) for shape in shapes]
    if saved.size != expected:
        raise ValueError(
            "The checkpoint holds the batch statistics of an open window for "
            f"{saved.size} values, but the model's training "
            f"BatchNormalization layers need {expected}. Load it into a "
            "model with the same layers, or call `model.apply_open_window()` "
            "before saving."
        )
    offsets = np.cumsum([0] + [int(np.prod(shape)) for shape in shapes])
    return [
        saved[offsets[i]:offsets[i + 1]].reshape(shape)
        for i, shape in enumerate(shapes)
    ]
