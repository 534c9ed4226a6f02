"""What every backend shares: it imports no backend and no Keras.

* `settings` — what the user chose (`n_gradients`, `flush_each_epoch`,
  `accumulator_dtype`, `measure_noise_scale`), validated once.
* `arithmetic` — the window's numbers, written once: how micro-batches are
  weighted, the window's mean gradient and loss, the loss-scale share of a
  micro-batch, the float16 overflow verdict, the noise-scale estimates. Each
  backend's window calls it with its own array operations.
* `variables` — questions about a variable every backend asks alike.
* `learning_rate` — what a window rule scales in an optimizer (a float
  learning rate, or a schedule's factor), read and set.
* `class_tree`, `messages`, `patch` — questions about a model's classes,
  the warnings and errors shared by the layers above, and scoped
  replacement of attributes.

The window on TensorFlow, which keeps the promise (n micro-batches of b
train like one batch of n*b) in TensorFlow's replica contexts, is
`accum_model.tensorflow`.

Vocabulary, used everywhere in accum_model: a *micro step* is one
micro-batch seen by `train_step`; a *window* is the micro steps whose
gradients make one optimizer update; a *gradient step* is that update.
"""
