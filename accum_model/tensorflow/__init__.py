"""The window on TensorFlow, shared by the Keras 3 and Keras 2 adapters.

A store of `core.window`'s state in per-replica variables, moved by its
transitions in TensorFlow's replica and cross-replica contexts. It imports
TensorFlow, never Keras: what each Keras does differently comes from its
adapter. Here is only what tf.distribute needs:

* `accumulation` — the `TensorFlowAccumulation` a model holds: the
  window's life cycle.
* `window` — the state's per-replica variables and the writes of the
  transitions' results.
* `window_end` — the one update (or skip) at the end of a window, and its
  one reduction across replicas; `replicas` hides which distribution
  context the code runs in.
* `train_step` — the training step, given each Keras's adapter.
* `optimizer_duties` — the compiled optimizer split into its loss scaler and
  its updater.
* `batch_statistics` — BatchNormalization's pooled moments.
* `checkpoint`, `tf_checkpoint` — the open window in checkpoints; `ops` —
  the core's array operations in TensorFlow.
"""
