"""What the window end's float16 range check costs under mixed_float16.

Under a `LossScaleOptimizer` the window end checks, for each weight its
layer uses in float16, whether the large batch's scaled float16 gradient
would leave float16's range (one maximum of absolute values per such weight
per window). This script trains the same mixed_float16 MLP as an
accumulating model (the check included) and as plain Keras at the same
micro-batch, in alternating rounds, and prints the median time per
micro-batch of each and their paired ratio: the window's whole cost, of
which the check is a part, bounds the check's from above.

Run: python benchmarks/float16_range_check.py [--rounds 7] [--width 1024]
"""

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402


def build(width, model_class, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    hidden = keras.layers.Dense(width, activation="relu")(inputs)
    hidden = keras.layers.Dense(width, activation="relu")(hidden)
    outputs = keras.layers.Dense(10, dtype="float32")(hidden)
    model = model_class(inputs, outputs, **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    return model


def time_per_micro_batch(model, x, y, micro_batch):
    model.fit(x, y, batch_size=micro_batch, epochs=1, verbose=0)  # traced
    start = time.perf_counter()
    model.fit(x, y, batch_size=micro_batch, epochs=1, verbose=0)
    return (time.perf_counter() - start) / (len(x) // micro_batch)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--n-gradients", type=int, default=4)
    arguments = parser.parse_args()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 256)).astype("float32")
    y = rng.normal(size=(2048, 10)).astype("float32")
    keras.mixed_precision.set_global_policy("mixed_float16")
    models = {
        "window": build(arguments.width, AccumulatingModel,
                        n_gradients=arguments.n_gradients),
        "plain Keras": build(arguments.width, keras.Model),
    }
    times = {name: [] for name in models}
    for _ in range(arguments.rounds):
        for name, model in models.items():
            times[name].append(time_per_micro_batch(
                model, x, y, arguments.micro_batch))
    ratios = [window / plain for window, plain in zip(times["window"],
                                                      times["plain Keras"])]
    parameters = sum(int(np.prod(v.shape))
                     for v in models["window"].trainable_weights)
    print(f"mixed_float16 MLP, {parameters} parameters, micro-batches of "
          f"{arguments.micro_batch}, n_gradients={arguments.n_gradients}, "
          f"{arguments.rounds} rounds")
    for name, values in times.items():
        print(f"{name}: {1e3 * statistics.median(values):.2f} ms per "
              "micro-batch (median)")
    print(f"window/plain: median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
