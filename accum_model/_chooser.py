"""Chooses the adapter for the Keras and backend this process trains with.

`adapter` is the one `accum_model.core.adapter.Adapter` the layers above
are written against, picked once as Keras picks its trainer. This is the
only module that imports an adapter, so a Keras 2 process never imports
Keras 3, nor a JAX process PyTorch. `keras` is the Keras package whose
`Model` `tf.keras.Model` is.
"""

from accum_model._stack import check_stack

KERAS_MAJOR, BACKEND = check_stack()

if KERAS_MAJOR == 2:
    from accum_model.keras2.adapter import Keras2Adapter as Adapter
elif BACKEND == "jax":
    from accum_model.keras3.jax_adapter import JaxAdapter as Adapter
elif BACKEND == "torch":
    from accum_model.keras3.torch_adapter import TorchAdapter as Adapter
else:
    from accum_model.keras3.tensorflow_adapter import (
        TensorFlowAdapter as Adapter)

adapter = Adapter()
keras = adapter.keras
