"""The Keras 3 adapter: every Keras 3 detail accum_model relies on.

`adapter.Keras3Adapter` answers the model layer alike on every backend
(see `accum_model.core.adapter`); each backend's subclass adds its
training step and window: `tensorflow_adapter.TensorFlowAdapter` (the
window of `accum_model.tensorflow`), `jax_adapter.JaxAdapter` and
`torch_adapter.TorchAdapter` (the window of `stateless_window`).
`accum_model._chooser` imports the one for this process's backend. Each
module says which Keras 3 versions its private details were checked on.
"""
