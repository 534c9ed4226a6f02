"""What every backend shares: it imports no backend and no Keras.

* `window` — the promise: the window's state (`WindowState`) and its
  transitions as pure functions over a backend's array operations. Each
  backend is a store that runs them (`accum_model.tensorflow` on
  per-replica variables, `keras3.stateless_window` on values).
* `arithmetic` — the numbers the transitions use: how micro-batches are
  weighted, the window's loss, the loss-scale share of a micro-batch, the
  float16 overflow verdict, pooled normalization moments, the noise-scale
  estimates; `numpy_ops` — its array operations in NumPy, for the core's
  own tests.
* `divisor` — what Keras divided a micro-batch's loss by (its weight).
* `lifecycle` — settings, epochs and the questions every backend's
  accumulation answers alike; `update_signal` — whether a run of the train
  function applied an update.
* `checkpoint_layout` — the open window in files, the same on every
  backend.
* `adapter` — the `Adapter` base: what the model layer asks of Keras and
  its backend.
* `settings` — what the user chose (`n_gradients`, `flush_each_epoch`,
  `accumulator_dtype`, `measure_noise_scale`), validated once.
* `optimizer_duties`, `learning_rate`, `variables`, `class_tree`,
  `messages`, `patch` — the compiled optimizer's duties, a window rule's
  learning rate, questions about variables and model classes, shared
  warnings, and scoped replacement of attributes.

Vocabulary, used everywhere in accum_model: a *micro step* is one
micro-batch seen by `train_step`; a *window* is the micro steps whose
gradients make one optimizer update; a *gradient step* is that update.
"""
