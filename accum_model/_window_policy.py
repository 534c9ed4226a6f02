"""The window as users steer and see it: length, dtype, update signal.

`n_gradients` is an int, or a schedule `{epoch: n}` whose values hold from
their (0-based) epoch on, with windows of 1 before the smallest key.
`accumulator_dtype` is the dtype the accumulators sum in. `UpdateSignal`
tells callbacks whether the micro-batch just trained ended with an update.
"""

import numbers

import tensorflow as tf

ACCUMULATOR_DTYPES = ("float32", "bfloat16", "float16", "float64")


def _is_int(value):
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_n_gradients(n_gradients):
    """Returns `n_gradients` (an int or an `{epoch: n}` dict), or raises.

    Raises:
        ValueError: Not an int >= 1, or a dict that is empty, has a key that
            is not an int >= 0 or a value that is not an int >= 1.
    """
    if isinstance(n_gradients, dict):
        if not n_gradients:
            raise ValueError(
                "`n_gradients` as a schedule must map at least one epoch to "
                "a window length, e.g. {0: 2, 10: 8}. Received: "
                "n_gradients={}"
            )
        for epoch, length in n_gradients.items():
            if not _is_int(epoch) or epoch < 0:
                raise ValueError(
                    "`n_gradients` schedule keys must be 0-based epoch "
                    f"numbers, ints >= 0. Received: key {epoch!r} in "
                    f"n_gradients={n_gradients!r}"
                )
            if not _is_int(length) or length < 1:
                raise ValueError(
                    "`n_gradients` schedule values must be window lengths, "
                    f"ints >= 1. Received: {epoch!r}: {length!r} in "
                    f"n_gradients={n_gradients!r}"
                )
        return {int(epoch): int(n_gradients[epoch])
                for epoch in sorted(n_gradients)}
    if not _is_int(n_gradients) or n_gradients < 1:
        raise ValueError(
            "`n_gradients` must be an integer >= 1 (the number of "
            "micro-batches whose gradients make one update), or a dict "
            "{epoch: n} scheduling it by epoch. "
            f"Received: n_gradients={n_gradients!r}"
        )
    return int(n_gradients)


def n_gradients_from_config(value):
    """`n_gradients` as `get_config` stored it (JSON makes keys strings)."""
    if isinstance(value, dict):
        return {
            int(k) if isinstance(k, str) and k.isdigit() else k: v
            for k, v in value.items()
        }
    return value


def check_accumulator_dtype(accumulator_dtype):
    """Returns the dtype's name, or raises a `ValueError`."""
    name = getattr(accumulator_dtype, "name", accumulator_dtype)
    if name not in ACCUMULATOR_DTYPES:
        raise ValueError(
            "`accumulator_dtype` must be one of "
            f"{', '.join(repr(d) for d in ACCUMULATOR_DTYPES)}. "
            f"Received: accumulator_dtype={accumulator_dtype!r}"
        )
    return name


class WindowPolicy:
    """Window length by epoch, and the accumulators' dtype.

    Args:
        n_gradients: Int >= 1, or a dict `{epoch: n}` (see module doc).
        accumulator_dtype: One of `ACCUMULATOR_DTYPES`.
    """

    def __init__(self, n_gradients, accumulator_dtype="float32"):
        self.n_gradients = check_n_gradients(n_gradients)
        self.accumulator_dtype = check_accumulator_dtype(accumulator_dtype)

    @property
    def accumulates(self):
        """Whether windows may hold more than one micro-batch.

        Only `n_gradients=1` (the int) trains with Keras's own step; a
        schedule accumulates even in its epochs of windows of 1, so that the
        optimizer state and the counters carry across its changes.
        """
        return self.n_gradients != 1

    def length_for_epoch(self, epoch):
        """Int. Micro-batches per window in the 0-based `epoch`."""
        if not isinstance(self.n_gradients, dict):
            return self.n_gradients
        length = 1
        for start, n in self.n_gradients.items():
            if start <= epoch:
                length = n
        return length

    @property
    def dtype(self):
        """The accumulators' `tf.DType`."""
        return tf.as_dtype(self.accumulator_dtype)

    @property
    def may_overflow(self):
        """Whether the accumulators can overflow where the gradients do not.

        float16 sums overflow above 65504; a window whose sum did is skipped
        and counted, with or without loss scaling, never applied.
        """
        return self.accumulator_dtype in ("float16", "bfloat16")


class UpdateSignal:
    """Whether the last run of the train function applied an update.

    Before each run of the train function (one micro-batch, or
    `steps_per_execution` of them) the optimizer's update count is copied,
    on the device, without waiting for it; `applied()` compares it with the
    count now, so only reading the signal waits for the step to finish.
    """

    def __init__(self):
        self._count_before = None
        self._optimizer = None

    def watching(self, train_function, optimizer):
        """Wraps `train_function` to note the count before each run."""

        def train_function_noting_updates(iterator):
            self._optimizer = optimizer
            self._count_before = tf.convert_to_tensor(_updates(optimizer))
            return train_function(iterator)

        return train_function_noting_updates

    def applied(self):
        if self._count_before is None:
            return False
        now = int(tf.convert_to_tensor(_updates(self._optimizer)).numpy())
        return now > int(self._count_before.numpy())


def _updates(optimizer):
    # Under loss scaling the inner optimizer counts the updates applied
    # (before keras 3.9 the outer one keeps a count of its own).
    return getattr(optimizer, "inner_optimizer", optimizer).iterations
