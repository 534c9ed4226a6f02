"""Fine-tune a keras-hub causal LM with gradient accumulation, token-exact.

A small GPT-2 (built from a config: nothing is downloaded) trains on
sequences whose real lengths run from 2 to 16 tokens under a
`padding_mask`, in windows of 4 micro-batches of 8 sequences; the data's
60 sequences end in a short micro-batch of 4. Each run starts from the
same weights, once for each of two losses:

* keras-hub's default, `SparseCategoricalCrossentropy(from_logits=True)`
  with the padding mask as sample weight: the loss summed over real
  tokens, divided by every position of the batch, padding included;
* the token mean fine-tuners expect, `reduction="mean_with_sample_weight"`:
  the loss over the batch's real tokens, divided by their number.

For each it prints how far from plain Keras with the large batch (32
sequences) the weights land: `accumulating(model, n_gradients=4)` on
micro-batches of 8, and Keras's own `gradient_accumulation_steps=4`, which
averages micro-batches as if each held as many tokens as the others (and
as many sequences). The floor is plain Keras against itself with each
batch's sequences in reverse order: float32 rounding.

Plain SGD: with Adam, Keras's TensorFlow update of an embedding's sparse
gradient takes a repeated row's terms one at a time, so the large batch
is not the reference there (docs/exactness.md).

Needs keras-hub (`pip install keras-hub`; the test extra has it). Run:
KERAS_BACKEND=jax python examples/finetune_causal_lm.py
"""

import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# TensorFlow's C++ (which keras-hub imports on every backend) writes its
# start-up notices (CUDA's "failed call to cuInit" on a machine without a
# GPU, CPU instructions) to stderr before any log level applies: stderr is
# closed while the libraries start, and Python errors still show.
_stderr = os.dup(2)
os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
try:
    import keras  # noqa: E402
    import keras_hub  # noqa: E402

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf  # noqa: E402

        tf.config.list_logical_devices()  # device start-up notices
finally:
    os.dup2(_stderr, 2)
# tf.data's and tf.function's advice on the plain runs' input pipelines and
# retracing is not this example's to act on.
logging.getLogger("tensorflow").setLevel(logging.ERROR)
try:
    from absl import logging as absl_logging
except ImportError:
    pass
else:
    absl_logging.set_verbosity(absl_logging.ERROR)
import numpy as np  # noqa: E402

from accum_model import accumulating  # noqa: E402

SEQUENCE = 16
VOCABULARY = 64
MICRO_BATCH = 8
N_GRADIENTS = 4
LOSSES = {
    "keras-hub's default loss (divided by every position)":
        lambda: keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    "token mean (reduction='mean_with_sample_weight')":
        lambda: keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight"),
}


def token_data(sequences=60, seed=0):
    """Token ids of very different real lengths, their next tokens, and the
    padding mask of those targets as sample weights."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, VOCABULARY, size=(sequences, SEQUENCE + 1))
    lengths = rng.integers(2, SEQUENCE + 1, size=sequences)
    mask = np.arange(SEQUENCE + 1)[None, :] < lengths[:, None]
    tokens = np.where(mask, tokens, 0).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": mask[:, :-1]}
    return x, tokens[:, 1:], mask[:, 1:].astype("float32")


def causal_lm(weights=None):
    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=VOCABULARY, num_layers=1, num_heads=2, hidden_dim=32,
        intermediate_dim=64, max_sequence_length=SEQUENCE, dropout=0.0)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone,
                                          preprocessor=None)
    if weights is not None:
        model.set_weights(weights)
    return model


def trained(weights, loss, batch_size, order=None, n_gradients=None,
            keras_steps=None, sequences=None):
    """A copy of the model trained for one epoch (of the first `sequences`,
    or all): plain Keras, or with `accumulating` (`n_gradients`), or with
    Keras's own accumulation (`keras_steps`)."""
    model = causal_lm(weights)
    if n_gradients is not None:
        model = accumulating(model, n_gradients=n_gradients)
    optimizer = (keras.optimizers.SGD(0.5) if keras_steps is None else
                 keras.optimizers.SGD(
                     0.5, gradient_accumulation_steps=keras_steps))
    model.compile(optimizer=optimizer, loss=loss, weighted_metrics=[])
    x, y, sample_weight = token_data()
    if sequences is not None:
        order = np.arange(sequences)
    if order is not None:
        x = {key: value[order] for key, value in x.items()}
        y, sample_weight = y[order], sample_weight[order]
    model.fit(x, y, sample_weight=sample_weight, batch_size=batch_size,
              epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def max_difference(weights_a, weights_b):
    return max(float(np.max(np.abs(a - b)))
               for a, b in zip(weights_a, weights_b))


def main():
    initial = causal_lm().get_weights()
    large = MICRO_BATCH * N_GRADIENTS
    sequences = len(token_data()[1])
    reversed_within = np.concatenate([
        np.arange(start, min(start + large, sequences))[::-1]
        for start in range(0, sequences, large)])
    print(f"GPT-2 of {sum(w.size for w in initial):,} weights on "
          f"{keras.backend.backend()}; {sequences} sequences, windows of "
          f"{N_GRADIENTS} micro-batches of {MICRO_BATCH} (the last "
          f"micro-batch holds {sequences % MICRO_BATCH}), large batch "
          f"{large}")
    results = {}
    for name, make_loss in LOSSES.items():
        reference = trained(initial, make_loss(), large)
        results[name] = {
            "accum_model": max_difference(trained(
                initial, make_loss(), MICRO_BATCH, n_gradients=N_GRADIENTS),
                reference),
            "keras": max_difference(trained(
                initial, make_loss(), MICRO_BATCH, keras_steps=N_GRADIENTS),
                reference),
            # One window of four full micro-batches: where Keras's average
            # is exact, it is exact here.
            "keras_full_window": max_difference(trained(
                initial, make_loss(), MICRO_BATCH, keras_steps=N_GRADIENTS,
                sequences=large), trained(initial, make_loss(), large,
                                          sequences=large)),
            "floor": max_difference(trained(
                initial, make_loss(), large, order=reversed_within),
                reference),
        }
        row = results[name]
        print(f"{name}: max |weight difference| against the large batch")
        for label, value in (
                (f"accumulating(model, n_gradients={N_GRADIENTS})",
                 row["accum_model"]),
                (f"Keras's gradient_accumulation_steps={N_GRADIENTS}",
                 row["keras"]),
                ("  the same, first window only (no short micro-batch)",
                 row["keras_full_window"]),
                ("float32 floor (large batch, reordered)", row["floor"])):
            print(f"  {label:<54}{value:.2e}")
    return results


if __name__ == "__main__":
    main()
