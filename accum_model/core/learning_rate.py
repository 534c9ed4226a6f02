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
