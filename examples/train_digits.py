"""Train a small CNN on scikit-learn's digits with gradient accumulation.

The same network is trained from the same initial weights as an
`AccumulatingModel` on micro-batches of 16 with `n_gradients=4`, and as a
plain `keras.Model` on batches of 64. Accumulation promises that the two end
up with the same weights, to float32 rounding. The script prints how far
apart they are, next to how far plain Keras moves from itself when each
batch of 64 holds the same samples in another order (grouped by label): the
same training in exact arithmetic, so that is the float32 rounding floor,
on every backend. Each model compiles as Keras compiles it by default on
the backend in use. The accumulating model also measures the gradient noise
scale (`measure_noise_scale=True`, which changes no weight) and prints it
per epoch next to its window of 64 samples.

Run: python examples/train_digits.py
"""

import argparse
import contextlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


@contextlib.contextmanager
def native_start_up_notices_hidden():
    """Hides what TensorFlow's C++ prints to stderr as it starts.

    Its oneDNN and CUDA notices are written before any log level applies
    (TF_CPP_MIN_LOG_LEVEL does not reach them); Python errors still show.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


with native_start_up_notices_hidden():
    import keras  # noqa: E402

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf  # noqa: E402

        tf.config.list_logical_devices()  # device start-up notices

import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402


def load_data():
    """Returns (x_train, y_train), (x_val, y_val) as 8x8x1 float32 images."""
    digits = load_digits()
    images = (digits.images / 16.0).astype("float32")[..., None]
    labels = digits.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(images))
    images, labels = images[order], labels[order]
    split = int(0.8 * len(images))
    return (images[:split], labels[:split]), (images[split:], labels[split:])


def build_cnn(model_class, activation="tanh", **kwargs):
    """A small convolutional classifier built with `model_class`.

    tanh rather than ReLU: under Adam a ReLU unit that comes back to life
    takes a step of the learning rate's size from a gradient at rounding
    level, so two float32 runs of the same ReLU training can part by 1e-3
    (see docs/exactness.md), and this example compares float32 runs.
    """
    inputs = keras.Input((8, 8, 1))
    x = keras.layers.Conv2D(16, 3, padding="same",
                            activation=activation)(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(32, 3, padding="same", activation=activation)(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


class UpdateCounter(keras.callbacks.Callback):
    """Prints how many optimizer updates each epoch applied."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start = int(self.model.optimizer.iterations.numpy())

    def on_epoch_end(self, epoch, logs=None):
        updates = int(self.model.optimizer.iterations.numpy()) - self.start
        line = (f"  epoch {epoch + 1}: {updates} optimizer updates, "
                f"val_accuracy={logs['val_accuracy']:.3f}")
        if "noise_scale" in logs:
            noise_scale = logs["noise_scale"]
            line += (f", noise_scale={noise_scale:.0f} samples"
                     if np.isfinite(noise_scale) else
                     ", noise_scale: the gradient is still below its noise"
                     if noise_scale > 0 else ", noise_scale: not measured")
        print(line)


def max_weight_difference(model_a, model_b):
    return max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model_a.get_weights(), model_b.get_weights())
    )


def grouped_by_label(labels, batch_size):
    """An order of the samples in which each batch of `batch_size` holds
    the same samples as in the given order, grouped by their label."""
    return np.concatenate([
        start + np.argsort(labels[start:start + batch_size], kind="stable")
        for start in range(0, len(labels), batch_size)])


def main(epochs=5, micro_batch=16, n_gradients=4, activation="tanh"):
    (x_train, y_train), validation = load_data()
    keras.utils.set_random_seed(0)

    accumulating = build_cnn(AccumulatingModel, activation,
                             n_gradients=n_gradients,
                             measure_noise_scale=n_gradients > 1)
    plain = build_cnn(keras.Model, activation)
    plain_reordered = build_cnn(keras.Model, activation)
    for model in (plain, plain_reordered):
        model.set_weights(accumulating.get_weights())
    for model in (accumulating, plain, plain_reordered):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss="sparse_categorical_crossentropy",
            metrics=["accuracy"],
        )

    print(f"AccumulatingModel: micro-batches of {micro_batch}, "
          f"n_gradients={n_gradients}")
    accumulating.fit(
        x_train, y_train, batch_size=micro_batch, epochs=epochs,
        validation_data=validation, shuffle=False, verbose=0,
        callbacks=[UpdateCounter()],
    )
    print(f"keras.Model: batches of {micro_batch * n_gradients}")
    plain.fit(
        x_train, y_train, batch_size=micro_batch * n_gradients, epochs=epochs,
        validation_data=validation, shuffle=False, verbose=0,
        callbacks=[UpdateCounter()],
    )

    order = grouped_by_label(y_train, micro_batch * n_gradients)
    plain_reordered.fit(
        x_train[order], y_train[order], batch_size=micro_batch * n_gradients,
        epochs=epochs, shuffle=False, verbose=0,
    )

    difference = max_weight_difference(accumulating, plain)
    rounding_floor = max_weight_difference(plain_reordered, plain)
    _, accuracy = accumulating.evaluate(*validation, verbose=0)
    print(f"validation accuracy: {accuracy:.3f} ({keras.backend.backend()})")
    print(f"max |weight difference| accumulated vs large batch: "
          f"{difference:.2e}")
    print(f"max |weight difference| large batch, samples in another order: "
          f"{rounding_floor:.2e}")
    return difference, rounding_floor


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--n-gradients", type=int, default=4)
    parser.add_argument("--activation", default="tanh",
                        help="of the convolutions (relu: see build_cnn)")
    args = parser.parse_args()
    main(args.epochs, args.micro_batch, args.n_gradients, args.activation)
