"""The open window in every checkpoint of the model.

A checkpoint taken between two updates holds the weights and optimizer state
of the last update; without the window, the micro-batches seen since then
would be lost on resume. `TensorFlowWindowCheckpoint` is an attribute of the model that
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

import weakref

import numpy as np
import tensorflow as tf

from accum_model.core import checkpoint_layout as layout
from accum_model.core import window as core_window
from accum_model.tensorflow import replicas
from accum_model.tensorflow.ops import TF_OPS
from accum_model.tensorflow.tf_checkpoint import SavedInTfCheckpoints


class TensorFlowWindowCheckpoint(SavedInTfCheckpoints, layout.RestoredWindow):
    """Saves and restores the window of an `Accumulation`.

    Args:
        accumulation: The `Accumulation` whose window is saved.
    """

    def __init__(self, accumulation):
        layout.RestoredWindow.__init__(self)
        self._accumulation = weakref.ref(accumulation)
        # The window-sizing callback's state, as a child object: a
        # checkpoint saved without it (before it existed) still restores,
        # where a key of this object's own that the file lacks fails.
        self._track_trackable(_SizerState(self), name=layout.SIZER)

    def _window(self):
        accumulation = self._accumulation()
        return None if accumulation is None else accumulation.window

    def saved_state(self):
        """The window as arrays: the same keys whether or not it exists."""
        window = self._window()
        if window is None:
            # A restore reads the dtypes this gives: those of the window
            # the model will build.
            return self._pending or layout.empty_state(
                np.float64 if self._accumulation().settings.accumulator_dtype
                == "float64" else np.float32)
        # Read in cross-replica context: synchronised-on-read sums come back
        # summed over replicas (and workers), counters as the first replica's.
        # Narrow accumulators are saved as float32 (what every file format
        # holds); float64 ones as they are.
        saved_dtype = (
            tf.float64 if any(s.dtype == tf.float64
                              for s in window.gradient_sums)
            else tf.float32
        )
        return layout.saved_state(
            [tf.cast(s.read_value(), saved_dtype).numpy()
             for s in window.gradient_sums],
            window.has_gradient,
            {name: getattr(window, name).read_value().numpy()
             for name in layout.COUNTERS},
            window.statistics.saved_sums(),
            window.statistics.names,
        )

    def _window_exists(self):
        return self._window() is not None

    def _write(self, arrays):
        _write(self._window(), arrays, self._accumulation())


def window_dtype_refusal(error):
    """A `ValueError` naming `accumulator_dtype` for TensorFlow's restore
    `error` where the error is the window's dtype differing from the
    file's, else None.

    TensorFlow reads each saved tensor as the dtype the restoring object
    gives it (the window's: float64 or float32, see `saved_state`) and
    refuses a file that holds the other.
    """
    message = str(getattr(error, "message", error))
    # `_window_checkpoint`: the model's attribute that holds this object
    # (accumulating_model.py), in the saved tensor's name.
    if ("_window_checkpoint" not in message
            or "does not equal original dtype" not in message):
        return None
    saved = "float64" if "original dtype double" in message else "float32"
    wanted = ("accumulator_dtype='float64'" if saved == "float64" else
              "another accumulator_dtype than 'float64' (such as the "
              "default, 'float32')")
    return ValueError(
        f"The checkpoint's window is saved as {saved}, and this model's "
        "window is saved as the other (float64 accumulators as float64, "
        "any other as float32): build the restoring model with "
        f"{wanted}.")


class _SizerState(SavedInTfCheckpoints):
    """`RestoredWindow.sizer_state` in TensorFlow checkpoints: NaNs while
    there is none."""

    def __init__(self, window_checkpoint):
        self._window_checkpoint = weakref.ref(window_checkpoint)

    def saved_state(self):
        state = self._window_checkpoint().sizer_state
        return {"state": np.full([layout.SIZER_LENGTH], np.nan)
                if state is None else np.asarray(state, np.float64)}

    def restore_state(self, arrays):
        state = np.asarray(arrays["state"], np.float64)
        self._window_checkpoint().sizer_state = (
            None if np.all(np.isnan(state)) else state)


def _write(window, arrays, accumulation):
    """Writes `arrays` into `window` (eagerly, cross-replica context).

    The open window keeps the length it was started with; the windows after
    it take the model's own length, which may differ from the saving
    model's.
    """
    strategy = window.strategy
    sizes = [int(s.shape.num_elements()) for s in window.gradient_sums]
    gradients, has_gradient, counters = layout.window_to_write(
        arrays, sizes, float(window.skipped_windows.read_value().numpy()))
    statistics = layout.statistics_to_write(
        arrays, window.statistics.call_shapes, counters,
        window.statistics.names)
    num_replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        for gradient_sum, value in zip(window.gradient_sums, gradients):
            replicas.assign_on_every_replica(
                gradient_sum,
                value.reshape(gradient_sum.shape) / num_replicas)
        if window.statistics.sums is not None:
            replicas.assign_on_every_replica(
                window.statistics.sums,
                window.statistics.joined(statistics) / num_replicas)
    # Each replica takes an equal share of the sums.
    window.update(lambda state: core_window.restored(state, {
        name: value / num_replicas if name in layout.SUMMED else value
        for name, value in counters.items()}, TF_OPS), everywhere=True)
    window.has_gradient = [
        now or saved for now, saved in zip(window.has_gradient, has_gradient)
    ]
    window.set_length(accumulation.window_length())

