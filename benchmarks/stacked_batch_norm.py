"""Stacked BatchNormalization: which layers get the large batch's moving
statistics, and what the others get.

A window pools each BatchNormalization layer's moments over its
micro-batches. A layer whose input no training-mode normalisation touched
upstream sees, micro-batch by micro-batch, slices of exactly what the
large batch's pass feeds it: its pooled moments are the large batch's. A
deeper layer's input was normalised by the layers before it with each
micro-batch's own moments, so its pooled moments are of other numbers.

For each model this trains, from the same initial weights, plain Keras on
batches of n*b ("large batch"), an AccumulatingModel on micro-batches of b
("window": one momentum step per window from the pooled moments), and the
same with BatchNormalization left to itself ("micro-batch updates": one
momentum step per micro-batch, what the optimizer's own accumulation
gives), and prints:

* at learning rate 0, per BatchNormalization layer in call order: how far
  the large batch moved its moving variance from the start, and how far
  the window's and the micro-batch updates' moving statistics end from the
  large batch's (the largest difference of mean or variance);
* at learning rate 0 and at `--learning-rate`, the evaluation loss of the
  three (inference mode, so it reads the moving statistics) on held-out
  data.

Run: python benchmarks/stacked_batch_norm.py [--models mobilenet_v2 resnet]
"""

import argparse
import os
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402
from accum_model import accumulating  # noqa: E402
# The same switch as the single-layer benchmark beside this one.
from batch_normalization import micro_batch_updates  # noqa: E402


def mobilenet_v2(model_class, **kwargs):
    keras.utils.set_random_seed(3)
    model = keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), classes=10)
    if model_class is keras.Model:
        return model
    return accumulating(model, **kwargs)


def resnet(model_class, **kwargs):
    """Three residual blocks, each conv-BN-ReLU-conv-BN plus the shortcut."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((32, 32, 3))
    hidden = keras.layers.Conv2D(16, 3, padding="same")(inputs)
    hidden = keras.layers.ReLU()(keras.layers.BatchNormalization()(hidden))
    for filters in (16, 32, 64):
        shortcut = keras.layers.Conv2D(filters, 1, strides=2)(hidden)
        block = keras.layers.Conv2D(filters, 3, strides=2,
                                    padding="same")(hidden)
        block = keras.layers.ReLU()(keras.layers.BatchNormalization()(block))
        block = keras.layers.Conv2D(filters, 3, padding="same")(block)
        block = keras.layers.BatchNormalization()(block)
        hidden = keras.layers.ReLU()(keras.layers.Add()([block, shortcut]))
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    outputs = keras.layers.Dense(10, activation="softmax")(hidden)
    return model_class(inputs, outputs, **kwargs)


MODELS = {"mobilenet_v2": mobilenet_v2, "resnet": resnet}


def data(samples, seed):
    rng = np.random.default_rng(seed)
    x = (rng.normal(size=(samples, 32, 32, 3)) * 0.5 + 0.5).astype("float32")
    y = rng.integers(0, 10, size=samples)
    return x, y


def batch_norms(model):
    return [layer for layer in model._flatten_layers()
            if isinstance(layer, keras.layers.BatchNormalization)]


def train(build, kind, x, y, micro_batch, n_gradients, learning_rate,
          epochs):
    if kind == "large batch":
        model, batch_size = build(keras.Model), micro_batch * n_gradients
    else:
        model = build(AccumulatingModel, n_gradients=n_gradients)
        batch_size = micro_batch
    if kind == "micro-batch updates":
        micro_batch_updates(model)
    model.compile(optimizer=keras.optimizers.SGD(learning_rate),
                  loss="sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(x, y, batch_size=batch_size, epochs=epochs,
                  shuffle=False, verbose=0)
    return model


def statistics(model):
    return [(np.asarray(layer.moving_mean), np.asarray(layer.moving_variance))
            for layer in batch_norms(model)]


KINDS = ("large batch", "window", "micro-batch updates")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=sorted(MODELS),
                        choices=sorted(MODELS))
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--n-gradients", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=0.05)
    args = parser.parse_args()
    x, y = data(args.samples, seed=0)
    x_test, y_test = data(args.samples, seed=1)
    print(f"keras {keras.__version__} ({keras.backend.backend()}); "
          f"{args.samples} images, b={args.micro_batch}, "
          f"n={args.n_gradients}, {args.epochs} epochs, SGD")
    for name in args.models:
        build = MODELS[name]
        started = time.perf_counter()
        at_zero = {kind: train(build, kind, x, y, args.micro_batch,
                               args.n_gradients, 0.0, args.epochs)
                   for kind in KINDS}
        reference = statistics(at_zero["large batch"])
        initial = statistics(build(keras.Model))
        print(f"\n{name}: {len(reference)} BatchNormalization layers, "
              "learning rate 0")
        print("| depth | layer | large batch moved its variance by | "
              "window vs large batch | micro-batch updates vs large batch |")
        print("|---|---|---|---|---|")
        layers = batch_norms(at_zero["large batch"])
        deviations = {kind: [max(float(np.max(np.abs(a - c))),
                                 float(np.max(np.abs(b - d))))
                             for (a, b), (c, d) in zip(
                                 statistics(at_zero[kind]), reference)]
                      for kind in KINDS[1:]}
        for depth, layer in enumerate(layers):
            moved = float(np.max(np.abs(reference[depth][1]
                                        - initial[depth][1])))
            print(f"| {depth} | {layer.name} | {moved:.2e} | "
                  f"{deviations['window'][depth]:.2e} | "
                  f"{deviations['micro-batch updates'][depth]:.2e} |")
        losses = {0.0: {kind: at_zero[kind].evaluate(x_test, y_test,
                                                     verbose=0)
                        for kind in KINDS}}
        losses[args.learning_rate] = {
            kind: train(build, kind, x, y, args.micro_batch,
                        args.n_gradients, args.learning_rate,
                        args.epochs).evaluate(x_test, y_test, verbose=0)
            for kind in KINDS}
        print(f"\n{name}: evaluation loss on held-out data (inference "
              "mode, moving statistics)")
        print("| learning rate | " + " | ".join(KINDS) + " |")
        print("|---|---|---|---|")
        for rate, row in losses.items():
            print(f"| {rate:g} | "
                  + " | ".join(f"{row[kind]:.4f}" for kind in KINDS) + " |")
        print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
