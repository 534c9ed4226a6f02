"""The Keras 2 adapter: every Keras 2 detail accum_model relies on.

`adapter.Keras2Adapter` answers the model layer (see
`accum_model.core.adapter`), which reaches this package only through
`accum_model._chooser`. `package.keras` is the package behind `tf.keras`:
`tf_keras` (with `TF_USE_LEGACY_KERAS=1`) or TensorFlow 2.13-2.15's own
`keras`. Each module says which Keras 2 versions it was checked on.
"""
