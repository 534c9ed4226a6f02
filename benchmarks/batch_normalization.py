"""How far a Conv+BatchNormalization model is from the large batch.

Trains a small CNN with BatchNormalization (momentum 0.99) on 128 generated
images for 2 epochs, once with plain Keras on batches of 32 and once per
(micro-batch b, n_gradients n) with b*n = 32, from the same initial weights,
and prints, against plain Keras: the largest difference of a trainable
weight, of the moving mean and of the moving variance, and the evaluation
loss (inference mode, moving statistics) of both.

"micro-batch updates" is what BatchNormalization does by itself in a window
(one momentum step per micro-batch, from the micro-batch's statistics);
"window" is what AccumulatingModel does (one momentum step per window, from
the window's pooled statistics). At learning rate 0 the window's moving
statistics equal the large batch's to float32 rounding; with a learning
rate, the gradients still come from micro-batch-normalised activations.

Run: python benchmarks/batch_normalization.py [--learning-rate 0.05]
"""

import argparse
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402


def build(model_class, **kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.Conv2D(8, 3, padding="same")(inputs)
    hidden = keras.layers.BatchNormalization(momentum=0.99,
                                             name="norm")(hidden)
    hidden = keras.layers.ReLU()(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    return model_class(inputs, keras.layers.Dense(1)(hidden), **kwargs)


def data(samples=128):
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(samples, 8, 8, 3)) * 2.0 + 1.0).astype("float32")
    y = (x.mean(axis=(1, 2, 3))[:, None]
         + 0.1 * rng.normal(size=(samples, 1))).astype("float32")
    return x, y


class _OwnCall(keras.layers.BatchNormalization):
    """BatchNormalization as a class that writes its own `call`: the window
    leaves such a layer's moving statistics alone (fit() warns)."""

    def call(self, *args, **kwargs):
        return super().call(*args, **kwargs)


def micro_batch_updates(model):
    """`model` with every BatchNormalization left to itself: a momentum
    step per micro-batch, as without the window's pooling."""
    for layer in model._flatten_layers():
        if type(layer) is keras.layers.BatchNormalization:
            layer.__class__ = _OwnCall
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--learning-rate", type=float, default=0.05)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    x, y = data()
    plain = build(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(args.learning_rate),
                  loss="mse")
    plain.fit(x, y, batch_size=32, epochs=args.epochs, shuffle=False,
              verbose=0)
    plain_loss = plain.evaluate(x, y, verbose=0)
    print(f"keras {keras.__version__}, SGD({args.learning_rate}), "
          f"{args.epochs} epochs, plain Keras batch 32: eval loss "
          f"{plain_loss:.4f}")
    print("| b / n | moving statistics | max Δ trainable | max Δ moving_mean "
          "| max Δ moving_variance | eval loss |")
    print("|---|---|---|---|---|---|")
    for micro_batch, n_gradients in ((2, 16), (4, 8), (8, 4)):
        for label in ("micro-batch updates", "window"):
            model = build(AccumulatingModel, n_gradients=n_gradients)
            if label == "micro-batch updates":
                micro_batch_updates(model)
            model.compile(optimizer=keras.optimizers.SGD(args.learning_rate),
                          loss="mse")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model.fit(x, y, batch_size=micro_batch, epochs=args.epochs,
                          shuffle=False, verbose=0)
            largest = {
                name: max(float(np.max(np.abs(a.numpy() - b.numpy())))
                          for a, b in zip(plain.weights, model.weights)
                          if _kind(a) == name)
                for name in ("trainable", "moving_mean", "moving_variance")
            }
            loss = model.evaluate(x, y, verbose=0)
            print(f"| {micro_batch} / {n_gradients} | {label} | "
                  f"{largest['trainable']:.2e} | "
                  f"{largest['moving_mean']:.2e} | "
                  f"{largest['moving_variance']:.2e} | {loss:.4f} |")


def _kind(variable):
    name = variable.path.split("/")[-1]
    if name in ("moving_mean", "moving_variance"):
        return name
    return "trainable" if variable.trainable else None


if __name__ == "__main__":
    main()
