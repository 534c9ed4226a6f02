"""How far exact and slightly misweighted models land from their floor in
`compare_with_large_batch`, under 16-bit compute.

A perceptron (6 -> Dense(16) -> tanh -> Dense(3), 96 generated samples,
windows of 4 micro-batches of 8, 3 windows) is checked with a mean squared
error, and with that error scaled by 1 + s * (its batch's mean target),
which a micro-batch holds of its own samples only (s = 0.03, 0.05): under
mixed_float16, and in float32 with one bfloat16 activation, with SGD and
Adam. Prints each verdict, the largest weight difference, and the allowed
difference and floor at the weight closest to its bound.

Run under each backend: KERAS_BACKEND=jax python benchmarks/large_batch_check_floor.py
"""

import numpy as np

import keras

from accum_model import compare_with_large_batch


def _batch_dependent(scale):
    def batch_dependent(y_true, y_pred):
        return keras.ops.mean((y_true - y_pred) ** 2, axis=-1) * (
            1.0 + scale * keras.ops.mean(y_true))
    return batch_dependent


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype("float32")
    w = rng.normal(size=(6, 3)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(96, 3))).astype("float32")
    print(f"keras {keras.__version__} on {keras.backend.backend()}")
    for optimizer in ("sgd", "adam"):
        for policy, activation_dtype in (("mixed_float16", None),
                                         ("float32", "bfloat16")):
            keras.mixed_precision.set_global_policy(policy)
            for scale in (0.0, 0.03, 0.05):
                keras.utils.set_random_seed(3)
                inputs = keras.Input((6,))
                hidden = keras.layers.Activation(
                    "tanh", dtype=activation_dtype)(
                        keras.layers.Dense(16)(inputs))
                model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
                model.compile(
                    optimizer=(keras.optimizers.SGD(0.1) if optimizer == "sgd"
                               else keras.optimizers.Adam(0.01)),
                    loss="mse" if scale == 0 else _batch_dependent(scale))
                result = compare_with_large_batch(model, x, y, batch_size=8,
                                                  n_gradients=4, steps=3)
                print(f"{optimizer:4s} {policy:13s} activation "
                      f"{activation_dtype or 'as policy':9s} s={scale:<4}: "
                      f"matches={result.matches!s:5s} max |difference| "
                      f"{result.max_weight_difference:.2e}, allowed "
                      f"{result.allowed_difference:.2e} (floor "
                      f"{result.rounding_floor:.2e}) at "
                      f"'{result.deciding_weight}'")
            keras.mixed_precision.set_global_policy("float32")


if __name__ == "__main__":
    main()
