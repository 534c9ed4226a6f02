"""The gradient noise scale: `measure_noise_scale=True` logs B_noise per epoch.

The reference is closed-form: for linear regression with a squared error,
each sample's gradient is known in numpy, so tr(Sigma)/|G|^2 over the data
set is computed exactly and the logged estimate is compared with it. The
learning rate is 0, so every window measures at the weights the reference
was computed at.
"""

import csv

import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model import accumulating
from backends import ON_TENSORFLOW
from backends import keras_2_too
from backends import tensorflow_only
from helpers import LossScaleOptimizer
from helpers import keras
from helpers import mlp
from helpers import regression_data
from helpers import weights_file

if ON_TENSORFLOW:
    import tensorflow as tf

pytestmark = keras_2_too

_TRUE_KERNEL = np.array([1.0, -0.5, 0.8, 0.3], np.float32)


def _linear_data(samples=8192, noise=2.0, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 4)).astype("float32")
    y = x @ _TRUE_KERNEL + noise * rng.normal(size=samples)
    return x, y.astype("float32")[:, None]


def _reference_noise_scale(x, y):
    """tr(Sigma)/|G|^2 of the mean squared error at kernel and bias 0."""
    residual = -y[:, 0].astype(np.float64)
    per_sample = np.concatenate(
        [2 * residual[:, None] * x, 2 * residual[:, None]], axis=1
    )
    mean = per_sample.mean(axis=0)
    trace = ((per_sample - mean) ** 2).sum(axis=1).mean()
    return trace / (mean @ mean)


def _linear_model(model_class=AccumulatingModel, **settings):
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1, kernel_initializer="zeros")(inputs)
    return model_class(inputs, outputs, **settings)


def _fit_logs(model, x, y, batch_size, epochs=1, loss="mse"):
    keras.utils.set_random_seed(0)  # the order fit() shuffles in
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss=loss)
    return model.fit(x, y, batch_size=batch_size, epochs=epochs,
                     verbose=0).history


@pytest.mark.parametrize("micro_batch, n_gradients", [(8, 4), (4, 8)])
def test_logged_noise_scale_is_the_data_sets(micro_batch, n_gradients):
    x, y = _linear_data()
    model = _linear_model(n_gradients=n_gradients, measure_noise_scale=True)
    history = _fit_logs(model, x, y, micro_batch, epochs=2)
    reference = _reference_noise_scale(x, y)
    assert len(history["noise_scale"]) == 2
    np.testing.assert_allclose(history["noise_scale"], reference, rtol=0.15)


def test_accumulating_model_measures_it():
    x, y = _linear_data(seed=1)
    inputs = keras.Input((4,))
    model = keras.Sequential(
        [inputs, keras.layers.Dense(1, kernel_initializer="zeros")]
    )
    accumulating(model, n_gradients=4, measure_noise_scale=True)
    history = _fit_logs(model, x, y, 8)
    np.testing.assert_allclose(history["noise_scale"],
                               _reference_noise_scale(x, y), rtol=0.15)


class LinearNet(AccumulatingModel):
    def __init__(self, **kwargs):
        super().__init__(n_gradients=4, measure_noise_scale=True, **kwargs)
        self.dense = keras.layers.Dense(1, kernel_initializer="zeros")

    def call(self, inputs):
        return self.dense(inputs)


def test_a_subclass_measures_it():
    x, y = _linear_data(seed=5)
    history = _fit_logs(LinearNet(), x, y, 8)
    np.testing.assert_allclose(history["noise_scale"],
                               _reference_noise_scale(x, y), rtol=0.15)


def test_a_summed_loss_is_measured_per_sample():
    # The gradient of a sum over a micro-batch is b times the mean's: the
    # estimate still counts samples.
    x, y = _linear_data(seed=2)
    model = _linear_model(n_gradients=4, measure_noise_scale=True)
    history = _fit_logs(model, x, y, 8,
                        loss=keras.losses.MeanSquaredError(reduction="sum"))
    np.testing.assert_allclose(history["noise_scale"],
                               _reference_noise_scale(x, y), rtol=0.15)


def test_two_replicas_measure_it(two_replicas):
    # Each replica's window is measured on its own (its micro-batches of 8
    # against its window of 32); the reduction carries the estimates.
    x, y = _linear_data(seed=3)
    with two_replicas.scope():
        model = _linear_model(n_gradients=4, measure_noise_scale=True)
        history = _fit_logs(model, x, y, 16)
    np.testing.assert_allclose(history["noise_scale"],
                               _reference_noise_scale(x, y), rtol=0.15)


def test_measuring_changes_no_weight():
    x, y = regression_data(samples=96)
    weights = {}
    for measure in (False, True):
        keras.utils.set_random_seed(3)
        model = mlp(AccumulatingModel, n_gradients=4,
                    measure_noise_scale=measure)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                            verbose=0).history
        assert ("noise_scale" in history) is measure
        weights[measure] = model.get_weights()
    for off, on in zip(weights[False], weights[True]):
        np.testing.assert_array_equal(off, on)


@tensorflow_only("reads the traced TensorFlow graph and variables")
def test_off_adds_no_variable_and_no_op():
    x, y = regression_data(samples=32)
    names = {}
    for measure in (False, True):
        model = mlp(AccumulatingModel, n_gradients=2,
                    measure_noise_scale=measure)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        step = tf.function(model.train_step)
        graph = step.get_concrete_function(
            (tf.constant(x[:8]), tf.constant(y[:8]))
        ).graph
        window = model._accumulation.window
        names[measure] = (
            [op.name for op in graph.get_operations()
             if "noise_scale" in op.name],
            [v.name for field, v in window.variables.items()
             if field.startswith("noise_")],
        )
    assert names[False] == ([], [])
    ops, variables = names[True]
    assert ops and len(variables) == 7


def test_windows_skipped_for_overflow_are_not_measured():
    # float16 accumulators overflow on every window: nothing is applied and
    # nothing is measured.
    x, y = _linear_data(samples=256)
    model = _linear_model(n_gradients=4, measure_noise_scale=True,
                          accumulator_dtype="float16")
    history = _fit_logs(model, x, y * 1e4, 8, epochs=1)
    assert model.skipped_windows == 8
    assert np.isnan(history["noise_scale"]).tolist() == [True]


def test_epochs_of_one_micro_batch_log_nan(tmp_path):
    x, y = _linear_data(samples=1024)
    model = _linear_model(n_gradients={0: 1, 1: 4}, measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    csv_path = tmp_path / "log.csv"
    history = model.fit(x, y, batch_size=8, epochs=3, verbose=0,
                        callbacks=[keras.callbacks.CSVLogger(csv_path)])
    noise_scale = history.history["noise_scale"]
    assert np.isnan(noise_scale).tolist() == [True, False, False]
    # CSVLogger takes its columns from the first epoch: the key is there.
    with open(csv_path) as rows:
        column = [row["noise_scale"] for row in csv.DictReader(rows)]
    np.testing.assert_allclose(np.array(column, float), noise_scale)


@tensorflow_only("reads the TensorFlow window's noise variables")
def test_a_window_restored_open_is_not_measured(tmp_path):
    x, y = _linear_data(samples=72)
    model = _linear_model(n_gradients=4, measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    model.train_on_batch(x[:8], y[:8])
    path = weights_file(tmp_path, "open")
    model.save_weights(path)
    restored = _linear_model(n_gradients=4, measure_noise_scale=True)
    restored.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    restored.train_on_batch(x[8:16], y[8:16])
    restored.load_weights(path)
    window = restored._accumulation.window
    assert restored._accumulation.open_micro_steps() == 1
    assert float(window.noise_measurable.read_value()) == 0.0
    # The window it completes is not counted; the next one is.
    for start in range(16, 72, 8):
        restored.train_on_batch(x[start:start + 8], y[start:start + 8])
    assert float(window.noise_estimates.read_value()) == 1.0


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_measure_noise_scale_must_be_a_bool(value):
    with pytest.raises(TypeError, match="measure_noise_scale"):
        _linear_model(n_gradients=4, measure_noise_scale=value)
    with pytest.raises(TypeError, match="measure_noise_scale"):
        accumulating(_linear_model(keras.Model), n_gradients=4,
                     measure_noise_scale=value)


@pytest.mark.parametrize("n_gradients", [1, {0: 1, 3: 1}])
def test_windows_of_one_cannot_be_measured(n_gradients):
    with pytest.raises(ValueError, match="n_gradients.*measure_noise_scale"):
        _linear_model(n_gradients=n_gradients, measure_noise_scale=True)
    model = _linear_model(n_gradients=4, measure_noise_scale=True)
    with pytest.raises(ValueError, match="n_gradients.*measure_noise_scale"):
        model.n_gradients = 1


def test_the_setting_is_saved_and_cloned(tmp_path):
    model = _linear_model(n_gradients=4, measure_noise_scale=True)
    assert model.get_config()["measure_noise_scale"] is True
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    clone = keras.models.clone_model(model)
    for copy in (loaded, clone):
        assert isinstance(copy, AccumulatingModel)
        assert copy.measure_noise_scale is True
        assert copy.n_gradients == 4


def test_mixed_precision_gives_the_float32_estimate():
    # float16 gradients under dynamic loss scaling (its first window
    # overflows at the initial scale and is not counted).
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _linear_data(seed=4)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(1, kernel_initializer="zeros")(inputs)
    outputs = keras.layers.Activation("linear", dtype="float32")(hidden)
    model = AccumulatingModel(inputs, outputs, n_gradients=4,
                              measure_noise_scale=True)
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.0)),
                  loss="mse")
    keras.utils.set_random_seed(0)
    history = model.fit(x, y, batch_size=8, epochs=1, verbose=0).history
    np.testing.assert_allclose(history["noise_scale"],
                               _reference_noise_scale(x, y), rtol=0.15)
