"""What the first `fit()` costs, tracing included, against plain Keras's.

Each configuration trains in a fresh process (so its first `fit()` traces
everything it needs), `keras.applications.MobileNetV2(weights=None)` on
generated 32x32x3 images by default (`--image-size` for others):

* "keras n*b": plain Keras with the large batch (the reference);
* "keras b": plain Keras with the micro-batch (the same steps' compute);
* "accum b x n": an `AccumulatingModel` with micro-batches of b.

and prints the wall time of the whole first `fit()`, of its first epoch,
and of what runs after its last epoch (`on_train_end` to the return), as
medians over `--rounds` interleaved rounds, with the ratio to the
reference.

Run: python benchmarks/first_fit.py [--rounds 3] [--backend jax|torch]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGURATIONS = ("keras n*b", "keras b", "accum b x n")


def child(args):
    import keras
    import numpy as np

    from accum_model import accumulating

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    size = args.image_size
    x = rng.normal(size=(args.samples, size, size, 3)).astype("float32")
    y = rng.integers(0, 10, size=args.samples)
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=(size, size, 3), classes=10)
    batch_size = args.micro_batch
    if args.configuration == "accum b x n":
        model = accumulating(model, n_gradients=args.n_gradients)
    elif args.configuration == "keras n*b":
        batch_size = args.micro_batch * args.n_gradients
    model.compile(optimizer=keras.optimizers.SGD(0.01),
                  loss="sparse_categorical_crossentropy")
    marks = {}

    class Marks(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            marks.setdefault("first_epoch", time.perf_counter())
            marks["last_epoch"] = time.perf_counter()

    import warnings

    warnings.simplefilter("ignore")
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch_size, epochs=args.epochs, shuffle=False,
              verbose=0, callbacks=[Marks()])
    end = time.perf_counter()
    print(json.dumps({"fit": end - start,
                      "first_epoch": marks["first_epoch"] - start,
                      "after_last_epoch": end - marks["last_epoch"]}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--n-gradients", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"),
                        default="tensorflow")
    parser.add_argument("--configuration", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.configuration:
        child(args)
        return
    env = {**os.environ, "KERAS_BACKEND": args.backend,
           "TF_CPP_MIN_LOG_LEVEL": "3"}
    times = {name: [] for name in CONFIGURATIONS}
    for round_index in range(args.rounds):
        order = (CONFIGURATIONS[round_index % 3:]
                 + CONFIGURATIONS[:round_index % 3])
        for name in order:
            result = subprocess.run(
                [sys.executable, __file__, "--configuration", name,
                 "--samples", str(args.samples), "--micro-batch",
                 str(args.micro_batch), "--n-gradients",
                 str(args.n_gradients), "--epochs", str(args.epochs),
                 "--image-size", str(args.image_size)],
                env=env, capture_output=True, text=True, check=True)
            times[name].append(json.loads(result.stdout.strip().splitlines()
                                          [-1]))
    b, n = args.micro_batch, args.n_gradients
    print(f"{args.backend}; MobileNetV2 {args.image_size}x{args.image_size}"
          f", {args.samples} images, "
          f"{args.epochs} epochs, b={b}, n={n}; median of {args.rounds} "
          "fresh processes (s)")
    print("| configuration | first fit() | first epoch | after the last "
          "epoch | first fit() / keras n*b |")
    print("|---|---|---|---|---|")
    reference = statistics.median(t["fit"] for t in times["keras n*b"])
    for name in CONFIGURATIONS:
        row = {key: statistics.median(t[key] for t in times[name])
               for key in ("fit", "first_epoch", "after_last_epoch")}
        label = name.replace("n*b", str(n * b)).replace(
            "b x n", f"{b} x {n}").replace("keras b", f"keras {b}")
        print(f"| {label} | {row['fit']:.1f} | {row['first_epoch']:.1f} | "
              f"{row['after_last_epoch']:.2f} | "
              f"{row['fit'] / reference:.2f} |")


if __name__ == "__main__":
    main()
