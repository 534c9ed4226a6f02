"""The adapter for the Keras this process trains with, chosen once at import.

`private` is `_keras_private` (Keras 3) or `_keras2_private` (Keras 2): the
two modules offer the same names, and everything else in accum_model is
written once against them. `keras` is the Keras module whose `Model`
`tf.keras.Model` is.
"""

from accum_model._stack import check_stack

KERAS_MAJOR = check_stack()

if KERAS_MAJOR == 2:
    from accum_model import _keras2_private as private
else:
    from accum_model import _keras_private as private

keras = private.keras

__all__ = ["KERAS_MAJOR", "keras", "private"]
