"""Keras 3's learning rate, as `WindowFromNoiseScale` moves it, on every
backend.

A float learning rate is an optimizer variable: it is set as it stands. A
`LearningRateSchedule` is wrapped once in `WindowScaledSchedule`, which
multiplies what the schedule returns by a scale, so the schedule keeps
running on the optimizer's `iterations` and the window only scales it.
TensorFlow and PyTorch read the scale's variable where the optimizer
evaluates the schedule. JAX's jitted step would freeze the variable's value
at tracing: the window ends of JAX and PyTorch (`stateless_window`) hand
the optimizer the scale their `WindowState` carries (`scaled_by`), which
the accumulation copies from the schedule between epochs. A bare callable
learning rate has no scale to set (`scalable_learning_rate` gives None).
Private `_learning_rate` checked on keras 3.6.0, 3.10.0 and 3.15.1.
"""

import contextlib

import keras
from keras import ops

from accum_model.core.learning_rate import FloatLearningRate
from accum_model.core.learning_rate import ScheduleScale
from accum_model.core.learning_rate import several_rates_message

_Schedule = keras.optimizers.schedules.LearningRateSchedule


@keras.saving.register_keras_serializable(package="accum_model")
class WindowScaledSchedule(_Schedule):
    """A learning-rate schedule times a scale that the window sets.

    Args:
        schedule: The `LearningRateSchedule` scaled (or its config).
        scale: Float. What the schedule's rate is multiplied by.
    """

    def __init__(self, schedule, scale=1.0):
        if isinstance(schedule, dict):
            schedule = keras.optimizers.schedules.deserialize(schedule)
        self.schedule = schedule
        self.scale = keras.Variable(float(scale), dtype="float32",
                                    trainable=False,
                                    name="window_learning_rate_scale")
        # The scale a window end hands over while the optimizer applies it.
        self._applied_scale = None

    def __call__(self, step):
        rate = ops.convert_to_tensor(self.schedule(step))
        scale = (self.scale if self._applied_scale is None
                 else self._applied_scale)
        return rate * ops.cast(scale, rate.dtype)

    def scale_value(self):
        return _as_float(self.scale)

    def get_config(self):
        return {"schedule": keras.optimizers.schedules.serialize(
                    self.schedule),
                "scale": self.scale_value()}


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)


def _rate_of(optimizer):
    """The learning rate `optimizer` (or the optimizer it wraps) holds: a
    variable, a schedule or a callable."""
    return getattr(_inner(optimizer), "_learning_rate", None)


def learning_rate_scale(optimizer):
    """Float. The scale `optimizer`'s schedule is multiplied by (1.0 where
    no window scales it)."""
    rate = _rate_of(optimizer)
    if isinstance(rate, WindowScaledSchedule):
        return rate.scale_value()
    return 1.0


@contextlib.contextmanager
def scaled_by(optimizer, scale):
    """While inside, `optimizer`'s scaled schedule uses `scale` (a traced
    value of the step) rather than its variable."""
    rate = _rate_of(optimizer)
    if not isinstance(rate, WindowScaledSchedule):
        yield
        return
    previous = rate._applied_scale
    rate._applied_scale = scale
    try:
        yield
    finally:
        rate._applied_scale = previous


def several_optimizers(optimizer):
    """The optimizers `optimizer` hands variables to (a `MultiOptimizer`'s
    `optimizers`, keras 3.15.1), or None for an optimizer of its own."""
    inner = getattr(_inner(optimizer), "optimizers", None)
    return list(inner) if isinstance(inner, (list, tuple)) else None


def learning_rate_of(optimizer):
    """Float. The learning rate `optimizer` (or, under loss scaling, the
    optimizer it wraps) applies at its next update, a schedule's included;
    None for a callable, or an optimizer of several rates."""
    if several_optimizers(optimizer) is not None:
        return None
    rate = _rate_of(optimizer)
    if hasattr(rate, "assign"):
        value = rate
    elif isinstance(rate, _Schedule):
        value = rate(_inner(optimizer).iterations)
    else:
        return None
    return _as_float(value)


def _as_float(value):
    """A scalar variable or tensor as a Python float, read through the
    backend's own `item()` (torch, JAX) or `numpy()` (TensorFlow). Keras's
    `convert_to_numpy` goes through the object's `__array__`, which NumPy 2
    warns of for torch's tensors and TensorFlow's variables, and which a
    `MirroredVariable` does not give at all (keras 3.15.1, torch 2.15,
    TensorFlow 2.21, numpy 2.4)."""
    if isinstance(value, keras.Variable):
        value = value.value
    value = ops.convert_to_tensor(value)
    for reader in ("item", "numpy"):
        if hasattr(value, reader):
            return float(getattr(value, reader)())
    return float(ops.convert_to_numpy(value))


def scalable_learning_rate(model):
    """What a window rule scales in `model`'s optimizer: an object with
    `value()` and `set(value)` for a float learning rate (the rate) or a
    `LearningRateSchedule` (a scale on it, wrapped in `WindowScaledSchedule`
    here once), or None for a callable learning rate.

    Raises:
        ValueError: The optimizer hands its variables to several
            optimizers (`MultiOptimizer`), each with its own rate.
    """
    several = several_optimizers(model.optimizer)
    if several is not None:
        raise ValueError(several_rates_message(model.optimizer, several))
    rate = _rate_of(model.optimizer)
    if hasattr(rate, "assign"):
        return FloatLearningRate(rate)
    if not isinstance(rate, _Schedule):
        return None
    if not isinstance(rate, WindowScaledSchedule):
        rate = WindowScaledSchedule(rate)
        _inner(model.optimizer)._learning_rate = rate
        # A step traced before holds the bare schedule: trace it anew.
        model.train_function = None
    # JAX's and PyTorch's window carries the factor in its state.
    return ScheduleScale(rate, getattr(
        model._accumulation, "follow_learning_rate_scale", None))
