"""Where Keras's own `ScheduleFreeAdamW` strays from its algorithm.

Trains a small perceptron (128 generated samples, 2 epochs, learning rate
0.01) with `ScheduleFreeAdamW`, from the same initial weights, as plain
Keras with batches of 32 (its optimizer built by `fit()`, and built before
`fit()`) and as an `AccumulatingModel` with 4 micro-batches of 8, and
prints the largest weight difference of each against the algorithm as
written: Keras's update read with the momentum as it was before the step
(what JAX's stateless update computes), run here in NumPy.

Run under each backend: KERAS_BACKEND=jax python benchmarks/schedule_free.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402

LEARNING_RATE = 0.01
BETA_1, BETA_2, EPSILON = 0.9, 0.999, 1e-8


def _data(samples=128):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 6)).astype("float32")
    y = np.tanh(x @ rng.normal(size=(6, 3))).astype("float32")
    return x, y


def _mlp(model_class, **kwargs):
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return model_class(inputs, keras.layers.Dense(3)(hidden), **kwargs)


def _initial_weights():
    return [np.random.default_rng(i).normal(size=w.shape).astype("float32")
            * 0.3 for i, w in enumerate(_mlp(keras.Model).get_weights())]


def _trained(model_class, batch_size, build_first=False, **kwargs):
    x, y = _data()
    model = _mlp(model_class, **kwargs)
    model.set_weights(_initial_weights())
    model.compile(optimizer=keras.optimizers.ScheduleFreeAdamW(
        LEARNING_RATE), loss="mse")
    if build_first:
        model.optimizer.build(model.trainable_variables)
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False,
              verbose=0)
    return model.get_weights()


def _algorithm(batch_size=32):
    """The large batch in NumPy, the momentum read before each step."""
    x, y = _data()
    weights = [w.astype("float64") for w in _initial_weights()]
    momentums = [w.copy() for w in weights]
    velocities = [np.zeros_like(w) for w in weights]
    step = 0
    for _ in range(2):
        for start in range(0, len(x), batch_size):
            xb, yb = x[start:start + batch_size], y[start:start + batch_size]
            kernel, bias, out_kernel, out_bias = weights
            hidden = np.tanh(xb @ kernel + bias)
            error = 2 * (hidden @ out_kernel + out_bias - yb) / yb.size
            d_hidden = (error @ out_kernel.T) * (1 - hidden ** 2)
            gradients = [xb.T @ d_hidden, d_hidden.sum(0),
                         hidden.T @ error, error.sum(0)]
            step += 1
            for i, gradient in enumerate(gradients):
                velocities[i] += (gradient ** 2 - velocities[i]) * (1 - BETA_2)
                denominator = np.sqrt(
                    velocities[i] / (1 - BETA_2 ** step)) + EPSILON
                momentum_before = momentums[i]
                momentums[i] = momentum_before - (
                    LEARNING_RATE * gradient / denominator)
                averaged = (weights[i] - (1 - BETA_1) * momentum_before) / BETA_1
                averaged = (1 - 1 / step) * averaged + momentums[i] / step
                weights[i] = (1 - BETA_1) * momentums[i] + BETA_1 * averaged
    return weights


def _difference(weights, reference):
    return max(float(np.max(np.abs(a - b)))
               for a, b in zip(weights, reference))


def main():
    reference = _algorithm()
    rows = {
        "plain Keras, batches of 32, optimizer built by fit()":
            _trained(keras.Model, 32),
        "plain Keras, batches of 32, optimizer built before fit()":
            _trained(keras.Model, 32, build_first=True),
        "AccumulatingModel, 4 micro-batches of 8":
            _trained(AccumulatingModel, 8, n_gradients=4),
    }
    print(f"keras {keras.__version__} on {keras.backend.backend()}: largest "
          "|weight difference| from the algorithm (momentum read before "
          "the step)")
    for name, weights in rows.items():
        print(f"  {name}: {_difference(weights, reference):.1e}")


if __name__ == "__main__":
    main()
