"""Every private Keras or TensorFlow detail accum_model relies on.

Checked against keras 3.15.1 and tensorflow 2.21.0. Each helper names the
private member it touches, so a Keras upgrade is one file to review.
"""

import tensorflow as tf
from keras.src.backend.common.masking import get_keras_mask
from keras.src.models.functional import Functional
from keras.src.saving import object_registration

__all__ = [
    "Functional",
    "serialize_as",
    "get_keras_mask",
    "loss_tracker",
    "strategy_supports_no_merge_call",
]


def loss_tracker(model):
    """Returns the `Mean` metric that `fit()` reports as "loss", or None.

    Keras keeps it in the private `Trainer._loss_tracker`; its own
    `train_step` updates it directly and no public accessor exists.
    """
    return getattr(model, "_loss_tracker", None)


def strategy_supports_no_merge_call():
    """Whether the current strategy may run its updates without `merge_call`.

    `tf.__internal__.distribute.strategy_supports_no_merge_call` is what
    Keras's own optimizers consult for the same decision.
    """
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def serialize_as(alias_class, registered_class):
    """Makes Keras serialize `alias_class` under `registered_class`'s name.

    `keras.saving.get_registered_name` reads the private
    `GLOBAL_CUSTOM_NAMES`; the name still resolves to `registered_class` when
    loading, because `GLOBAL_CUSTOM_OBJECTS` is left as it is.
    """
    names = object_registration.GLOBAL_CUSTOM_NAMES
    if registered_class in names:
        names[alias_class] = names[registered_class]
