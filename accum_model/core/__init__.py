"""The window, written once for every Keras: it imports TensorFlow, not Keras.

What a newcomer needs to know, in the order data flows through it:

* `settings` — what the user chose (`n_gradients`, `flush_each_epoch`,
  `accumulator_dtype`), validated once.
* `accumulation` — the `Accumulation` a model holds: the promise (n
  micro-batches of b train like one batch of n*b) is kept there.
* `window` — per-replica accumulators and counters of the open window.
* `divisor` — what each micro-batch's loss was divided by, which weights
  its gradients in the window.
* `window_end` — the one update (or skip) at the end of a window, and the
  window's one reduction across replicas; `replicas` hides which
  distribution context the code runs in.
* `optimizer_duties` — the compiled optimizer split into its loss scaler and
  its updater (each Keras adapter fills in the Keras-specific part).
* `checkpoint`, `tf_checkpoint` — the open window in checkpoints.
* `class_tree`, `messages` — questions about a model's classes, and the
  warnings and errors shared by the layers above.

Vocabulary, used everywhere in accum_model: a *micro step* is one
micro-batch seen by `train_step`; a *window* is the micro steps whose
gradients make one optimizer update; a *gradient step* is that update.
"""
