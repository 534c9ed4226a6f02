"""How an open window is laid out in a file, the same on every backend.

A window is saved as the whole window (its sums over replicas, its
counters as they are) in five arrays: "gradients" (every accumulator,
flattened and concatenated), "sizes" (each accumulator's number of
elements), "has_gradient", "counters" (`COUNTERS`, in that order) and
"statistics" (BatchNormalization's pooled sums). A file saved while no
window existed holds the same keys, empty; a file without them (a plain
`keras.Model`'s) is read as an empty window. So a file saved on one backend
restores on another.
"""

import warnings

import numpy as np

from accum_model.core.messages import counted

# Counters saved with the window, in the order of the "counters" array. The
# windows after the open one take the loading model's length, so only the
# open window's own length is saved.
COUNTERS = ("weight_sum", "sample_sum", "micro_steps", "skipped_windows",
            "length", "loss_sum")
# The layout's version, saved after the counters: 2 sorts the statistics by
# layer name (`file_order`); a file without it (version 0) holds them in
# the order of the store that wrote it.
VERSION = 2

# Counters summed over replicas (the others are equal on every replica).
SUMMED = ("weight_sum", "sample_sum", "loss_sum")


# The state of the window-sizing callback (`WindowFromNoiseScale`), saved
# beside the window once it has run: float64 [smoothed noise scale (NaN:
# none yet), starting n_gradients, starting learning rate or schedule
# factor (NaN: none), current n_gradients].
SIZER = "window_sizer"
SIZER_LENGTH = 4


def empty_state(gradient_dtype=np.float32):
    """The arrays of a file saved while no window existed (its gradients of
    the dtype the window saves, see `saved_state`)."""
    return {
        "gradients": np.zeros([0], gradient_dtype),
        "sizes": np.zeros([0], np.int64),
        "has_gradient": np.zeros([0], np.int8),
        "counters": np.array([0.0] * len(COUNTERS) + [VERSION], np.float64),
        "statistics": np.zeros([0], np.float32),
    }


def saved_state(gradient_sums, has_gradient, counters, statistics=(),
                statistics_names=()):
    """The arrays to save for a window (NumPy arrays in, NumPy out).

    Args:
        gradient_sums: List of arrays, each accumulator summed over
            replicas (float32, or float64 where the accumulators are).
        has_gradient: List of bools, one per accumulator.
        counters: Dict of floats by the names of `COUNTERS`.
        statistics: List of arrays, the pooled batch statistics, in the
            store's order.
        statistics_names: The layer name of each, saved sorted by it.

    Raises:
        ValueError: `statistics_names` does not name every entry (an entry
            left unnamed would be left out of the file).
    """
    if len(statistics_names) != len(statistics):
        raise ValueError(
            f"statistics_names names {len(statistics_names)} entries, but "
            f"there are {len(statistics)} statistics entries to save")
    flat = [np.reshape(s, [-1]) for s in gradient_sums]
    statistics = [np.reshape(statistics[i], [-1])
                  for i in file_order(statistics_names)]
    return {
        "gradients": (np.concatenate(flat) if flat
                      else np.zeros([0], np.float32)),
        "sizes": np.array([s.size for s in flat], np.int64),
        "has_gradient": np.array(has_gradient, np.int8),
        "counters": np.array([counters[name] for name in COUNTERS]
                             + [VERSION], np.float64),
        "statistics": (np.concatenate(statistics) if statistics
                       else np.zeros([0], np.float32)),
    }


def read(arrays):
    """The saved arrays as NumPy arrays, every key present.

    A file saved without a window (by a model that never trained, or a
    plain `keras.Model`) reads as an empty window; one saved before the
    loss sum was kept logs no loss for its micro-batches so far.
    """
    if "sizes" not in arrays:
        arrays = empty_state()
    arrays = {key: np.asarray(value) for key, value in arrays.items()}
    counters = arrays["counters"]
    arrays["counters"] = np.concatenate(
        [counters, np.zeros([len(COUNTERS) + 1 - len(counters)])])
    return arrays


def counter(arrays, name):
    """One counter of `read` arrays (or "version", the layout's), as a
    float."""
    return float(arrays["counters"][(COUNTERS + ("version",)).index(name)])


def window_to_write(arrays, sizes, skipped_windows):
    """What to write into a window of accumulators of `sizes` elements.

    Args:
        arrays: `read` arrays.
        sizes: List of ints, the loading window's accumulator sizes.
        skipped_windows: Float, the loading window's count, kept when the
            file holds no window.

    Returns:
        (gradient sums as a list of flat arrays, has_gradient as a list of
        bools, counters as a dict by name).

    Raises:
        ValueError: The file's window was built for other weights.
    """
    saved_sizes = [int(n) for n in arrays["sizes"]]
    counters = dict(zip(COUNTERS, arrays["counters"].tolist()))
    if not saved_sizes:
        # No window was saved: nothing is open; the window keeps its count
        # of skipped windows.
        counters["skipped_windows"] = skipped_windows
        return ([np.zeros([n], np.float32) for n in sizes],
                [False] * len(sizes), counters)
    if saved_sizes != sizes:
        raise ValueError(
            "The checkpoint holds a gradient window for trainable weights of "
            f"sizes {saved_sizes}, but the model's trainable weights have "
            f"sizes {sizes}. Load it into a model with the same trainable "
            "weights, or call `model.apply_open_window()` before saving."
        )
    offsets = np.cumsum([0] + sizes)
    gradients = [arrays["gradients"][offsets[i]:offsets[i + 1]]
                 for i in range(len(sizes))]
    return gradients, [bool(h) for h in arrays["has_gradient"]], counters


class RestoredWindow:
    """A window read from a file, written into the window once it exists.

    Files are often loaded before the first training step builds the window
    (build, compile, `load_weights`): the arrays wait here, and count as
    the open window meanwhile. Each backend's checkpoint subclasses this and
    says whether its window exists (`_window_exists`) and how to write
    `read` arrays into it (`_write`).
    """

    def __init__(self):
        # A restored window waiting for the model to build its own.
        self._pending = None
        # Micro steps of the window the last restore wrote (or holds).
        self.restored_micro_steps = 0
        # The window-sizing callback's state (`SIZER`), saved or restored,
        # or None.
        self.sizer_state = None

    def has_state(self):
        """Whether there is a window to save: built, or restored and
        waiting for the model to build its own."""
        return self._window_exists() or self._pending is not None

    def with_sizer_state(self, arrays):
        """`arrays` (a window to save) with the sizing callback's state."""
        if arrays is not None and self.sizer_state is not None:
            arrays = {**arrays, SIZER: np.asarray(self.sizer_state,
                                                  np.float64)}
        return arrays

    def restore_state(self, arrays):
        """Restores the window saved as `arrays` (empty: no window open)."""
        if SIZER in arrays:
            self.sizer_state = np.asarray(arrays[SIZER], np.float64)
        arrays = read(arrays)
        self.restored_micro_steps = int(counter(arrays, "micro_steps"))
        if not self._window_exists():
            self._pending = arrays
            return
        self._pending = None
        self._write(arrays)

    def empty(self):
        """Empties the open window, and forgets one waiting to be written,
        as loading a file without a window does."""
        self._pending = None
        self.restored_micro_steps = 0
        if self._window_exists():
            self._write(read({}))

    def window_built(self, window=None):
        """Writes a restored window into the window the model just built."""
        del window
        if self._pending is not None:
            arrays, self._pending = self._pending, None
            self._write(arrays)

    def pending_count(self, name):
        """A counter of the restored window not yet written, else 0.

        Args:
            name: "micro_steps" or "skipped_windows".
        """
        if self._pending is None:
            return 0
        return int(counter(self._pending, name))

    def _window_exists(self):
        raise NotImplementedError

    def _write(self, arrays):
        raise NotImplementedError


def file_order(layer_names):
    """Where each of a window's statistics entries goes in a file: entries
    sorted by their layer's name, a layer's calls in call order, so that
    every backend writes and reads them alike (TensorFlow holds them in the
    order the step calls the layers, JAX and PyTorch in the model's layer
    order).

    Args:
        layer_names: The layer name of each entry, in the store's order.

    Returns:
        The store's indices of the entries, in file order.
    """
    return sorted(range(len(layer_names)), key=lambda i: (layer_names[i], i))


def statistics_to_write(arrays, shapes, counters, names):
    """The saved batch statistics, one array of `shapes` per entry of the
    loading window, in the store's order (`read` arrays; `counters` as
    `window_to_write` gives; `names`, each entry's layer name).

    A window saved without them (by a model whose normalization layers moved
    their own statistics) has nothing pooled yet: zeros, and a warning when
    it holds micro-batches whose statistics the window then misses.
    """
    saved = np.asarray(arrays.get("statistics", np.zeros([0])))
    expected = sum(int(np.prod(shape)) for shape in shapes)
    if saved.size == 0 or not counters["micro_steps"]:
        if expected and counters["micro_steps"]:
            warnings.warn(
                "The checkpoint's open window holds "
                f"{counted(int(counters['micro_steps']), 'micro-batch')} "
                "but no "
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
    # Older files hold the entries in the order of the store that wrote
    # them: read as this store's.
    order = (file_order(names) if counter(arrays, "version") >= 2
             else list(range(len(shapes))))
    offsets = np.cumsum([0] + [int(np.prod(shapes[i])) for i in order])
    stored = [None] * len(shapes)
    for position, index in enumerate(order):
        stored[index] = saved[offsets[position]:offsets[position + 1]
                              ].reshape(shapes[index])
    return stored
