"""The window on TensorFlow, shared by the Keras 3 and Keras 2 adapters.

Stateful, in TensorFlow's replica and cross-replica contexts; its numbers
come from `accum_model.core.arithmetic`. It imports TensorFlow, never Keras:
what each Keras does differently comes from its adapter.

* `accumulation` — the `Accumulation` a model holds: the window's life cycle.
* `window` — per-replica accumulators and counters of the open window.
* `divisor` — what each micro-batch's loss was divided by.
* `window_end` — the one update (or skip) at the end of a window, and its one
  reduction across replicas; `replicas` hides which distribution context the
  code runs in.
* `training` — the training step, given each Keras's details.
* `optimizer_duties` — the compiled optimizer split into its loss scaler and
  its updater.
* `batch_statistics`, `noise_scale` — BatchNormalization's pooled moments and
  the gradient noise scale, measured from the windows.
* `checkpoint`, `tf_checkpoint` — the open window in checkpoints;
  `update_signal` — whether the last step applied an update.
"""
