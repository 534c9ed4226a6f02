"""What `micro_batch_size` costs: memory and time per sample, against plain
Keras at the large batch and the `n_gradients` mode at the micro-batch.

Three ways to train on batches of B samples:

- plain: `keras.Model` with `fit(batch_size=B)` (where it fits: an
  out-of-memory error is printed as "does not fit");
- split: `AccumulatingModel(micro_batch_size=b)` with `fit(batch_size=B)`;
- windows: `AccumulatingModel(n_gradients=B // b)` with `fit(batch_size=b)`.

For an MLP and a small transformer it prints, per way, the step's memory
and the time per sample of a few epochs after the first (which compiles):
on JAX the compiled step's bytes on one device (`memory_analysis()`:
arguments, temporaries and outputs not written over the arguments); on
PyTorch on a GPU the peak of `torch.cuda.max_memory_allocated()`; on
TensorFlow and on a CPU's PyTorch, times only.

Run: KERAS_BACKEND=jax python benchmarks/micro_batch_size.py [--out DIR]
     [--batch 256] [--micro-batch 32] [--models mlp transformer]
"""

import argparse
import datetime
import os
import time

import keras
import numpy as np

from accum_model import AccumulatingModel
from harness import commit
from harness import jax_compiled_step
from harness import machine
from harness import write_json

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 2 ** 20


def mlp(model_class, **kwargs):
    inputs = keras.Input((512,))
    hidden = inputs
    for _ in range(4):
        hidden = keras.layers.Dense(1024, activation="relu")(hidden)
    return model_class(inputs, keras.layers.Dense(10)(hidden), **kwargs)


def mlp_data(samples):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(samples, 512)).astype("float32"),
            rng.integers(0, 10, (samples,)))


SEQUENCE, VOCABULARY, WIDTH = 128, 2000, 256


def transformer(model_class, **kwargs):
    """Two pre-norm encoder blocks over token and position embeddings,
    predicting the next token at every position."""
    tokens = keras.Input((SEQUENCE,), dtype="int32")
    positions = keras.ops.arange(SEQUENCE)
    hidden = (keras.layers.Embedding(VOCABULARY, WIDTH)(tokens)
              + keras.layers.Embedding(SEQUENCE, WIDTH)(positions))
    for _ in range(2):
        normed = keras.layers.LayerNormalization()(hidden)
        hidden = hidden + keras.layers.MultiHeadAttention(
            4, WIDTH // 4)(normed, normed, use_causal_mask=True)
        normed = keras.layers.LayerNormalization()(hidden)
        expanded = keras.layers.Dense(4 * WIDTH, activation="gelu")(normed)
        hidden = hidden + keras.layers.Dense(WIDTH)(expanded)
    logits = keras.layers.Dense(VOCABULARY)(
        keras.layers.LayerNormalization()(hidden))
    return model_class(tokens, logits, **kwargs)


def token_data(samples):
    rng = np.random.default_rng(0)
    x = rng.integers(1, VOCABULARY, (samples, SEQUENCE)).astype("int32")
    return x, np.roll(x, -1, axis=1)


MODELS = {"mlp": (mlp, mlp_data), "transformer": (transformer, token_data)}


def _compiled(build, way, batch, micro_batch):
    keras.utils.set_random_seed(0)
    if way == "plain":
        model = build(keras.Model)
    elif way == "split":
        model = build(AccumulatingModel, micro_batch_size=micro_batch)
    else:
        model = build(AccumulatingModel, n_gradients=batch // micro_batch)
    model.compile(optimizer=keras.optimizers.Adam(1e-4),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return model


def _step_mib(model, x, y, fit_batch):
    backend = keras.backend.backend()
    if backend == "jax":
        memory = jax_compiled_step(model, x[:fit_batch],
                                   y[:fit_batch]).memory_analysis()
        return (memory.argument_size_in_bytes + memory.temp_size_in_bytes
                + memory.output_size_in_bytes
                - memory.alias_size_in_bytes) / MIB
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            model.fit(x[:fit_batch * 2], y[:fit_batch * 2],
                      batch_size=fit_batch, epochs=1, shuffle=False,
                      verbose=0)
            return torch.cuda.max_memory_allocated() / MIB
    return None


def measure(name, way, batch, micro_batch, epochs):
    build, data = MODELS[name]
    x, y = data(batch * 4)
    model = _compiled(build, way, batch, micro_batch)
    fit_batch = micro_batch if way == "windows" else batch
    step_mib = _step_mib(model, x, y, fit_batch)
    if way != "plain":
        # The measurement trained one batch: apply it before the epochs.
        model.apply_open_window()
    # The first epoch compiles the step; the next ones are timed.
    model.fit(x, y, batch_size=fit_batch, epochs=1, shuffle=False, verbose=0)
    start = time.perf_counter()
    model.fit(x, y, batch_size=fit_batch, epochs=epochs, shuffle=False,
              verbose=0)
    seconds = time.perf_counter() - start
    return {"step_mib": step_mib,
            "microseconds_per_sample": seconds / (len(x) * epochs) * 1e6,
            "updates": int(model.optimizer.iterations)}


def _out_of_memory(error):
    """Whether `error` is a backend's out-of-memory error (plain Keras's
    large batch may not fit where a GPU is lent)."""
    text = f"{type(error).__name__} {error}"
    return any(sign in text for sign in (
        "OutOfMemory", "RESOURCE_EXHAUSTED", "ResourceExhausted",
        "out of memory"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--models", nargs="*", choices=list(MODELS),
                        default=list(MODELS))
    args = parser.parse_args()
    print(machine(), "commit", commit())
    results = {"machine": machine(), "commit": commit(),
               "batch": args.batch, "micro_batch": args.micro_batch,
               "models": {}}
    print(f"batches of {args.batch}; micro-batches of {args.micro_batch}")
    print(f"{'model':12s} {'way':8s} {'step MiB':>9s} {'us/sample':>10s}")
    for name in args.models:
        for way in ("plain", "split", "windows"):
            try:
                figures = measure(name, way, args.batch, args.micro_batch,
                                  args.epochs)
            except Exception as error:  # noqa: BLE001 - any backend's
                if not _out_of_memory(error):
                    raise
                results["models"].setdefault(name, {})[way] = None
                print(f"{name:12s} {way:8s} does not fit: "
                      f"{type(error).__name__}")
                continue
            results["models"].setdefault(name, {})[way] = figures
            mib = ("-" if figures["step_mib"] is None
                   else f"{figures['step_mib']:.1f}")
            print(f"{name:12s} {way:8s} {mib:>9s} "
                  f"{figures['microseconds_per_sample']:10.1f}")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    write_json(os.path.join(
        args.out, f"micro_batch_size-{keras.backend.backend()}-{stamp}.json"),
        results)


if __name__ == "__main__":
    main()
