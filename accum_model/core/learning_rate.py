"""What a window rule scales in an optimizer, read and set the same way
under every Keras: a float learning rate, or the factor on a schedule."""

import numpy as np


class FloatLearningRate:
    """A float learning rate (the optimizer's variable), read and set.

    Args:
        variable: The variable holding it (with `numpy()` and `assign`).
    """

    def __init__(self, variable):
        self._variable = variable

    def value(self):
        return float(np.asarray(self._variable.numpy()))

    def set(self, value):
        self._variable.assign(value)


class ScheduleScale:
    """The factor a window-scaled schedule multiplies its rate by.

    Args:
        schedule: The adapter's `WindowScaledSchedule` (its `scale` is a
            variable).
        on_set: Called after each change, or None (JAX's and PyTorch's
            window copies the factor into its state).
    """

    def __init__(self, schedule, on_set=None):
        self._schedule = schedule
        self._on_set = on_set

    def value(self):
        return self._schedule.scale_value()

    def set(self, value):
        self._schedule.scale.assign(value)
        if self._on_set is not None:
            self._on_set()


def several_rates_message(optimizer, optimizers):
    """Says that a window rule cannot scale an optimizer of several rates,
    and the fix."""
    names = ", ".join(type(o).__name__ for o in optimizers)
    return (
        "WindowFromNoiseScale(learning_rate=...) scales one learning rate, "
        f"and this {type(optimizer).__name__} hands the variables to "
        f"several optimizers ({names}), each with a rate of its own. Use "
        "learning_rate=None (the window is still sized), or one optimizer. "
        f"Received: optimizer={type(optimizer).__name__}")
