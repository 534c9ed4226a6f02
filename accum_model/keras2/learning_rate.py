"""Keras 2's learning rate, as `WindowFromNoiseScale` moves it.

A float learning rate is a variable: set as it stands. A
`LearningRateSchedule` is wrapped once in `Keras2WindowScaledSchedule`, whose
scale is a TensorFlow variable that the optimizer reads where it
evaluates the schedule, inside the compiled step. A legacy `OptimizerV2`
keeps its learning rate among its hyperparameters (`_get_hyper` /
`_set_hyper`, which create them), the optimizers of TF 2.11+ in
`_learning_rate`. Checked on TensorFlow 2.13.1, 2.15.1 and tf-keras 2.21.0.
"""

import numpy as np
import tensorflow as tf

from accum_model.core.learning_rate import FloatLearningRate
from accum_model.core.learning_rate import ScheduleScale
from accum_model.keras2.package import keras
from accum_model.keras2.package import src

_optimizer_v2 = src("optimizers.legacy.optimizer_v2")
_Schedule = keras.optimizers.schedules.LearningRateSchedule


@keras.utils.register_keras_serializable(package="accum_model",
                                         name="WindowScaledSchedule")
class Keras2WindowScaledSchedule(_Schedule):
    """A learning-rate schedule times a scale that the window sets.

    Args:
        schedule: The `LearningRateSchedule` scaled (or its config).
        scale: Float. What the schedule's rate is multiplied by.
    """

    def __init__(self, schedule, scale=1.0):
        super().__init__()
        if isinstance(schedule, dict):
            schedule = keras.optimizers.schedules.deserialize(schedule)
        self.schedule = schedule
        self.scale = tf.Variable(float(scale), dtype=tf.float32,
                                 trainable=False,
                                 name="window_learning_rate_scale")

    def __call__(self, step):
        rate = tf.convert_to_tensor(self.schedule(step))
        return rate * tf.cast(self.scale, rate.dtype)

    def scale_value(self):
        return float(self.scale.numpy())

    def get_config(self):
        return {"schedule": keras.optimizers.schedules.serialize(
                    self.schedule),
                "scale": self.scale_value()}


def _inner(optimizer):
    return getattr(optimizer, "inner_optimizer", optimizer)


def _rate_of(inner):
    if isinstance(inner, _optimizer_v2.OptimizerV2):
        return inner._get_hyper("learning_rate")
    return getattr(inner, "_learning_rate", None)


def learning_rate_of(optimizer):
    """Float. The learning rate `optimizer` (or, under loss scaling, the
    optimizer it wraps) applies at its next update, a schedule's included;
    None for a callable."""
    inner = _inner(optimizer)
    rate = _rate_of(inner)
    if isinstance(rate, _Schedule):
        rate = rate(inner.iterations)
    elif not hasattr(rate, "numpy"):
        return None
    return float(np.asarray(rate.numpy()))


def scalable_learning_rate(model):
    """What a window rule scales in `model`'s optimizer: an object with
    `value()` and `set(value)` for a float learning rate (the rate) or a
    `LearningRateSchedule` (a scale on it, wrapped in `Keras2WindowScaledSchedule`
    here once), or None for a callable learning rate."""
    inner = _inner(model.optimizer)
    rate = _rate_of(inner)
    if hasattr(rate, "assign"):
        return FloatLearningRate(rate)
    if not isinstance(rate, _Schedule):
        return None
    if not isinstance(rate, Keras2WindowScaledSchedule):
        rate = Keras2WindowScaledSchedule(rate)
        if isinstance(inner, _optimizer_v2.OptimizerV2):
            inner._set_hyper("learning_rate", rate)
        else:
            inner._learning_rate = rate
        # A step traced before holds the bare schedule: trace it anew.
        model.train_function = None
    return ScheduleScale(rate)
