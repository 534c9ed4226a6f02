"""Models, data and comparisons shared by the tests."""

import contextlib
import pathlib
import sys

import numpy as np

from accum_model import AccumulatingModel
# The Keras the model trains with: Keras 3, or Keras 2 (tf.keras 2) where
# the process runs it.
from accum_model._chooser import KERAS_MAJOR
from accum_model._chooser import keras

# The benchmarks count collectives with the same functions.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent
                       / "benchmarks"))
import harness  # noqa: E402

collective_reductions = harness.collective_reductions
compiled_jax_step = harness.jax_distributed_step_text
jax_all_reduces = harness.jax_all_reduces
traced_step = harness.traced_step


def regression_data(samples=100, features=6, outputs=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(samples, outputs))).astype(
        "float32"
    )
    return x, y


def classification_data(samples=100, features=6, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    y = (np.abs(x[:, 0] * 3 + x[:, 1]).astype(int) % classes).astype("int32")
    return x, y


def mlp(model_class, n_gradients=None, features=6, outputs=3, seed=1,
        activation=None, regularizer=None, **kwargs):
    """A two-layer perceptron built with the functional API of `model_class`
    (`regularizer` on its hidden kernel)."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(8, activation="tanh",
                                kernel_regularizer=regularizer)(inputs)
    predictions = keras.layers.Dense(outputs, activation=activation)(hidden)
    if n_gradients is not None:
        kwargs["n_gradients"] = n_gradients
    return model_class(inputs=inputs, outputs=predictions, **kwargs)


def windows_reference(x, y, windows, optimizer):
    """Plain Keras taking one step per window, on the window's samples."""
    plain = mlp(keras.Model)
    plain.compile(optimizer=optimizer, loss="mse")
    for window in windows:
        plain.train_on_batch(x[window], y[window])
    return plain


def aligned_copy(array, alignment=64):
    """A copy of `array` whose data starts on an `alignment`-byte boundary."""
    raw = np.empty(array.nbytes + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    aligned = raw[start:start + array.nbytes].view(array.dtype)
    aligned = aligned.reshape(array.shape)
    aligned[...] = array
    return aligned


def max_weight_difference(model_a, model_b):
    return max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(model_a.get_weights(), model_b.get_weights())
    )


def iterations(model):
    """Updates applied: the inner optimizer's count under loss scaling.

    Before keras 3.9, `LossScaleOptimizer.iterations` is a counter of its
    own that Keras never advances; the inner optimizer's is the real one.
    """
    optimizer = getattr(model.optimizer, "inner_optimizer", model.optimizer)
    return int(np.asarray(optimizer.iterations.numpy()))


def fit_both(build, make_optimizer, x, y, micro_batch, n_gradients,
             epochs=2, compile_kwargs=None, fit_kwargs=None,
             large_fit_kwargs=None, strategy=None, loss="mse",
             plain_compile_kwargs=None):
    """Trains plain Keras on batches of n*b and an AccumulatingModel on b.

    Both start from the same weights; returns (plain, accumulating).
    """
    compile_kwargs = compile_kwargs or {}
    fit_kwargs = fit_kwargs or {}
    plain = build(keras.Model)
    plain.compile(optimizer=make_optimizer(), loss=loss,
                  **(compile_kwargs if plain_compile_kwargs is None
                     else plain_compile_kwargs))
    plain.fit(x, y, batch_size=micro_batch * n_gradients, epochs=epochs,
              shuffle=False, verbose=0, **(large_fit_kwargs or fit_kwargs))
    if strategy is None:
        accumulating = build(AccumulatingModel, n_gradients=n_gradients)
        accumulating.compile(optimizer=make_optimizer(), loss=loss,
                             **compile_kwargs)
    else:
        with strategy.scope():
            accumulating = build(AccumulatingModel, n_gradients=n_gradients)
            accumulating.compile(optimizer=make_optimizer(), loss=loss,
                                 **compile_kwargs)
    accumulating.set_weights(build(keras.Model).get_weights())
    with (strategy.scope() if strategy is not None
          else contextlib.nullcontext()):
        accumulating.fit(x, y, batch_size=micro_batch, epochs=epochs,
                         shuffle=False, verbose=0, **fit_kwargs)
    return plain, accumulating


def skip_unless_executions_stop_cleanly(steps_per_execution=2):
    """Skips a test of `steps_per_execution > 1` on a Keras that refuses it
    (the refusal itself is tested in test_epochs.py), and on PyTorch, where
    Keras itself refuses it."""
    import pytest

    from accum_model._chooser import adapter

    if steps_per_execution > 1 and keras.backend.backend() == "torch":
        pytest.skip("Keras refuses steps_per_execution > 1 on PyTorch")
    if (steps_per_execution > 1
            and not adapter.executions_stop_cleanly_at_end_of_data()):
        pytest.skip("this Keras cannot stop an execution between steps")


class BatchMeanLoss(keras.losses.Loss):
    """A loss whose `call` already returns the batch mean (a scalar)."""

    def call(self, y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred))


def scalar_output_mlp(model_class, **kwargs):
    """A perceptron whose output has shape `(batch,)`."""
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Reshape(())(keras.layers.Dense(1)(hidden))
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def batch_norm_mlp(model_class, **kwargs):
    """A perceptron with a BatchNormalization after its hidden layer."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8)(inputs)
    hidden = keras.layers.BatchNormalization()(hidden)
    return model_class(inputs, keras.layers.Dense(3)(hidden), **kwargs)


def run_example(path, *arguments, timeout=300):
    """Runs a multi-process example with `--json`; returns its exit code
    and the JSON line it printed last."""
    import json
    import subprocess

    result = subprocess.run(
        [sys.executable, str(path), "--json", "--timeout", str(timeout),
         *arguments],
        capture_output=True, text=True, timeout=timeout + 120,
    )
    lines = [line for line in result.stdout.splitlines()
             if line.startswith("{")]
    assert lines, result.stdout[-3000:] + result.stderr[-3000:]
    return result.returncode, json.loads(lines[-1])


def run_script_printing_ok(script):
    """Runs `script` in a new Python process, `{keras}` in it standing for
    the module of the Keras the suite trains with, and checks that it exits
    cleanly after printing "ok"."""
    import subprocess

    result = subprocess.run(
        [sys.executable, "-c", script.replace("{keras}", keras.__name__)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def numpy_of(value):
    """A variable's or tensor's value as a NumPy array, on any backend (and
    under Keras 2, whose values are TensorFlow's)."""
    if KERAS_MAJOR == 2:
        return np.asarray(value)
    return np.asarray(keras.ops.convert_to_numpy(value))


def weights_file(directory, name):
    """A weights file that holds the open window: Keras 3's `.weights.h5`;
    under Keras 2, TensorFlow's checkpoint format (its h5 files cannot)."""
    return str(directory / (f"{name}.weights.h5" if KERAS_MAJOR == 3
                            else name))


def sum_of_squares(values):
    """A layer's scalar sum of `values` squared, under either Keras."""
    if KERAS_MAJOR == 2:
        import tensorflow as tf  # Keras 2 has no keras.ops.
        return tf.reduce_sum(tf.square(values))
    return keras.ops.sum(keras.ops.square(values))


def mean_of_squares(values):
    """A layer's scalar mean of `values` squared, under either Keras."""
    if KERAS_MAJOR == 2:
        import tensorflow as tf  # Keras 2 has no keras.ops.
        return tf.reduce_mean(tf.square(values))
    return keras.ops.mean(keras.ops.square(values))


# Keras's dynamic loss-scaling optimizer (Keras 2 keeps it in
# `keras.mixed_precision`).
LossScaleOptimizer = (keras.mixed_precision.LossScaleOptimizer
                      if KERAS_MAJOR == 2
                      else keras.optimizers.LossScaleOptimizer)


def loss_scale(optimizer):
    """Float: a `LossScaleOptimizer`'s current scale, under either Keras."""
    if KERAS_MAJOR == 2:
        return float(optimizer.loss_scale)
    return float(optimizer.dynamic_scale.numpy())


def counted_steps(steps, skipped):
    """What an optimizer's `iterations` reads after `steps` steps under
    dynamic loss scaling, `skipped` of them skipped for overflow: Keras 2's
    `LossScaleOptimizer` counts a skipped step, Keras 3's does not."""
    return steps if KERAS_MAJOR == 2 else steps - skipped


class ScaledFrom(keras.optimizers.schedules.LearningRateSchedule):
    """The large batch's learning rate where a window grows: `schedule`
    times `factor` from the update `start` on."""

    def __init__(self, schedule, factor, start):
        super().__init__()
        self.schedule, self.factor, self.start = schedule, factor, start

    def __call__(self, step):
        if KERAS_MAJOR == 2:
            import tensorflow as tf  # Keras 2 has no keras.ops.
            where, cast = tf.where, tf.cast
        else:
            where, cast = keras.ops.where, keras.ops.cast
        return self.schedule(step) * where(
            cast(step, "float32") >= self.start, self.factor, 1.0)


class AfterMicroBatch(keras.callbacks.Callback):
    """Calls `save(model)` after micro-batch `count` of the first epoch
    (through `self.model`, which on JAX holds the step's state)."""

    def __init__(self, count, save):
        super().__init__()
        self.count, self.save = count, save

    def on_train_batch_end(self, batch, logs=None):
        if batch + 1 == self.count:
            self.save(self.model)
