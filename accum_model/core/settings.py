"""The accumulation settings a user chooses, validated once.

`n_gradients` is an int, or a schedule `{epoch: n}` whose values hold from
their (0-based) epoch on, with windows of 1 before the smallest key.
`flush_each_epoch` says whether a window ends with its epoch.
`accumulator_dtype` is the dtype the accumulators sum in.
`measure_noise_scale` says whether windows measure the gradient noise scale.
`micro_batch_size` splits each batch `fit()` hands the step into micro-batches
of at most that many samples, all in the window (None: one micro-batch per
batch; "auto": the largest that fits the device, or `memory_limit` bytes).
"""

import numbers

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


def check_flush_each_epoch(flush_each_epoch):
    """Returns `flush_each_epoch`, or raises a `ValueError` if not a bool."""
    if not isinstance(flush_each_epoch, bool):
        raise ValueError(
            "`flush_each_epoch` must be True or False. "
            f"Received: flush_each_epoch={flush_each_epoch!r}"
        )
    return flush_each_epoch


def check_measure_noise_scale(measure_noise_scale, n_gradients,
                              micro_batch_size=None):
    """Returns `measure_noise_scale`, or raises.

    Raises:
        TypeError: Not a bool.
        ValueError: True, and no window holds two micro-batches (a window
            of one batch that `micro_batch_size` splits may).
    """
    if not isinstance(measure_noise_scale, bool):
        raise TypeError(
            "`measure_noise_scale` must be True or False. "
            f"Received: measure_noise_scale={measure_noise_scale!r}"
        )
    if (measure_noise_scale and max(window_lengths(n_gradients)) < 2
            and micro_batch_size is None):
        raise ValueError(
            "`measure_noise_scale=True` compares each micro-batch's gradient "
            "with its window's, which takes windows of 2 or more "
            "micro-batches: set `n_gradients` >= 2 (or give some epochs of "
            "its schedule 2 or more), or a `micro_batch_size` that splits "
            "each batch, or measure_noise_scale=False. "
            f"Received: n_gradients={n_gradients!r}, "
            "measure_noise_scale=True"
        )
    return measure_noise_scale


def check_micro_batch_size(micro_batch_size):
    """Returns `micro_batch_size` (None, an int >= 1 or "auto"), or raises.

    Raises:
        ValueError: None of these.
    """
    if micro_batch_size is None or micro_batch_size == "auto":
        return micro_batch_size
    if not _is_int(micro_batch_size) or micro_batch_size < 1:
        raise ValueError(
            "`micro_batch_size` must be None (each batch is one "
            "micro-batch), an integer >= 1, the most samples of a "
            "micro-batch that a step splits its batch into (per replica), "
            "or \"auto\" (the largest that fits the device). "
            f"Received: micro_batch_size={micro_batch_size!r}"
        )
    return int(micro_batch_size)


def check_memory_limit(memory_limit, micro_batch_size):
    """Returns `memory_limit` (None or an int > 0, bytes), or raises.

    Raises:
        ValueError: Not None or an int > 0, or given without
            `micro_batch_size="auto"`, the only setting that reads it.
    """
    if memory_limit is None:
        return None
    if not _is_int(memory_limit) or memory_limit <= 0:
        raise ValueError(
            "`memory_limit` must be None (the device's memory) or the "
            "bytes a training step may hold on one device, an integer > 0. "
            f"Received: memory_limit={memory_limit!r}"
        )
    if micro_batch_size != "auto":
        raise ValueError(
            "`memory_limit` is what micro_batch_size=\"auto\" fits the "
            "micro-batches to, and nothing else reads it: set "
            "micro_batch_size=\"auto\", or leave memory_limit=None. "
            f"Received: memory_limit={memory_limit!r}, "
            f"micro_batch_size={micro_batch_size!r}"
        )
    return int(memory_limit)


class Settings:
    """The constructor arguments of an accumulating model, validated.

    Args:
        n_gradients: Int >= 1, or a dict `{epoch: n}` (see module doc).
        flush_each_epoch: Bool.
        accumulator_dtype: One of `ACCUMULATOR_DTYPES`.
        measure_noise_scale: Bool.
        micro_batch_size: None, an int >= 1, or "auto".
        memory_limit: None, or an int > 0 (with `micro_batch_size="auto"`).

    Raises:
        ValueError: An argument is not one of its allowed values; the message
            names it.
        TypeError: `measure_noise_scale` is not a bool.
    """

    # The defaults of the model's constructor and of `accumulating()`.
    DEFAULTS = {"n_gradients": 1, "flush_each_epoch": True,
                "accumulator_dtype": "float32", "measure_noise_scale": False,
                "micro_batch_size": None, "memory_limit": None}

    def __init__(self, n_gradients=1, flush_each_epoch=True,
                 accumulator_dtype="float32", measure_noise_scale=False,
                 micro_batch_size=None, memory_limit=None):
        self.n_gradients = check_n_gradients(n_gradients)
        self.flush_each_epoch = check_flush_each_epoch(flush_each_epoch)
        self.accumulator_dtype = check_accumulator_dtype(accumulator_dtype)
        self.micro_batch_size = check_micro_batch_size(micro_batch_size)
        self.measure_noise_scale = check_measure_noise_scale(
            measure_noise_scale, self.n_gradients, self.micro_batch_size
        )
        self.memory_limit = check_memory_limit(memory_limit,
                                               self.micro_batch_size)

    @classmethod
    def from_config(cls, config, defaults=None):
        """Settings from a `get_config` dict; missing keys from `defaults`."""
        values = dict(defaults or cls.DEFAULTS)
        values.update({k: config[k] for k in cls.DEFAULTS if k in config})
        values["n_gradients"] = n_gradients_from_config(values["n_gradients"])
        return cls(**values)

    def as_dict(self):
        """The settings by constructor argument name."""
        return {name: getattr(self, name) for name in self.DEFAULTS}

    def non_defaults(self):
        """The settings that differ from the constructor's defaults."""
        return {k: v for k, v in self.as_dict().items()
                if v != self.DEFAULTS[k]}

    def __eq__(self, other):
        return isinstance(other, Settings) and (
            self.as_dict() == other.as_dict()
        )

    def __repr__(self):
        arguments = ", ".join(f"{k}={v!r}" for k, v in self.as_dict().items())
        return f"Settings({arguments})"

    @property
    def accumulates(self):
        """Whether windows may hold more than one micro-batch.

        Only `n_gradients=1` (the int) without `micro_batch_size` trains
        with Keras's own step; a schedule accumulates even in its epochs of
        windows of 1, so that the optimizer state and the counters carry
        across its changes.
        """
        return self.n_gradients != 1 or self.micro_batch_size is not None

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
    def may_overflow(self):
        """Whether the accumulators can overflow where the gradients do not.

        float16 sums overflow above 65504; a window whose sum did is skipped
        and counted, with or without loss scaling, never applied.
        """
        return self.accumulator_dtype in ("float16", "bfloat16")


def window_lengths(n_gradients):
    """The set of window lengths an `n_gradients` (an int, or a schedule
    `{epoch: n}`) gives."""
    return (set(n_gradients.values()) if isinstance(n_gradients, dict)
            else {n_gradients})
