"""Chooses the adapter for the Keras this process trains with, once.

`adapter` is `accum_model.keras3` or `accum_model.keras2`: the two packages
offer the same names (`__all__`), and everything above this module is
written once against them. This is the only module that imports an
adapter, so a Keras 2 process never imports Keras 3. `keras` is the Keras
package whose `Model` `tf.keras.Model` is.
"""

from accum_model._stack import check_stack

KERAS_MAJOR = check_stack()

# Only the chosen adapter is loaded: each imports its own Keras at the top.
if KERAS_MAJOR == 2:
    from accum_model import keras2 as adapter
else:
    from accum_model import keras3 as adapter

keras = adapter.keras

__all__ = ["KERAS_MAJOR", "adapter", "keras"]
