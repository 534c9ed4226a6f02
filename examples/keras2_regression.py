"""AccumulatingModel on Keras 2 (`tf.keras` from tf_keras or TF 2.13-2.15).

Run with TF_USE_LEGACY_KERAS=1 where TensorFlow is 2.16 or newer (and
tf-keras is installed), or as is on TensorFlow 2.13-2.15. Trains a small
regression model with 4 micro-batches of 16 per update and prints how far it
ends from plain Keras 2 trained on batches of 64.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402

keras = tf.keras  # Keras 2 here


def build(model_class, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((10,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    outputs = keras.layers.Dense(1)(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1000, 10)).astype("float32")
    y = (x @ rng.normal(size=(10, 1))).astype("float32")

    model = build(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0)

    large_batch = build(keras.Model)
    large_batch.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    large_batch.fit(x, y, batch_size=64, epochs=3, shuffle=False, verbose=0)

    difference = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model.get_weights(), large_batch.get_weights())
    )
    print(f"{keras.Model.__module__.split('.')[0]} (Keras 2), TensorFlow "
          f"{tf.__version__}: {int(model.optimizer.iterations)} updates, max |weight difference| vs batch 64: {difference:.2e}")


if __name__ == "__main__":
    main()
