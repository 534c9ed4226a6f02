"""Keras 2: the same promise on `tf.keras` 2 (tf_keras, or TF 2.13-2.15's).

Runs where `tf.keras` is Keras 2: `.ci/matrix` runs it with
`TF_USE_LEGACY_KERAS=1` on tensorflow-cpu 2.21.0 + tf-keras 2.21.0, and on
tensorflow-cpu 2.13.1. Elsewhere the whole module is skipped. Every model
here is built from `tf.keras`, and every reference is plain Keras 2 with the
large batch. What the topic files test under Keras 2 too (`keras_2_too`)
is not repeated here.
"""

import contextlib
import warnings

import numpy as np
import pytest
import tensorflow as tf

from accum_model import AccumulatingModel
from accum_model import WindowFromNoiseScale
from backends import ON_KERAS_2
from backends import keras_2_too
from helpers import ScaledFrom
from helpers import fit_both
from helpers import iterations
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data
from test_mixed_precision import _tanh_regression
from test_noise_scale import _linear_data
from test_noise_scale import _linear_model

pytestmark = [keras_2_too, pytest.mark.skipif(
    not ON_KERAS_2, reason="tf.keras is not Keras 2 here")]

keras = tf.keras
TOLERANCE = 1e-5

# Every kind of optimizer, clipping and schedule is test_exactness.py's.
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "legacy_sgd_momentum": lambda: keras.optimizers.legacy.SGD(
        0.1, momentum=0.9),
}


# Contract ---------------------------------------------------------------

def test_accumulating_model_is_the_processes_keras_2_model():
    assert issubclass(AccumulatingModel, keras.Model)
    model = mlp(AccumulatingModel, n_gradients=4)
    assert isinstance(model, keras.Model)
    assert model.n_gradients == 4


def test_keras_3_layers_inside_are_refused_by_name():
    other = pytest.importorskip("keras")
    if other.__version__.startswith("2."):
        pytest.skip("no Keras 3 in this environment")

    class Mixed(AccumulatingModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = other.layers.Dense(3)

        def call(self, inputs):
            return self.dense(inputs)

    x, y = regression_data()
    model = Mixed(n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="another Keras"):
        model.fit(x, y, batch_size=8, verbose=0)


# Losses -----------------------------------------------------------------

def test_sum_reduction_equals_the_large_batch():
    x, y = regression_data(samples=96)
    loss = keras.losses.MeanSquaredError(reduction="sum")
    # A summed loss has gradients ~100x the mean's: a smaller step.
    plain, model = fit_both(mlp, lambda: keras.optimizers.SGD(0.001), x, y, 8, 4, loss=loss)
    assert max_weight_difference(plain, model) <= TOLERANCE


def _scalar_sum(y_true, y_pred):
    return tf.reduce_sum(tf.square(y_true - y_pred))


class _ScalarSum(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return tf.reduce_sum(tf.square(y_true - y_pred))


@pytest.mark.parametrize("loss", [_scalar_sum, _ScalarSum()],
                         ids=["function", "loss_subclass"])
def test_a_scalar_loss_of_ones_own_is_warned_about_by_name(loss):
    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss=loss)
    with pytest.warns(UserWarning, match="returns one number.*"
                      "reduction='sum'.*`micro_batch_weight`"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_a_scalar_loss_declared_a_sum_equals_the_large_batch():
    x, y = regression_data(samples=96)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        plain, model = fit_both(mlp, lambda: keras.optimizers.SGD(0.001), x, y, 8, 4, loss=_ScalarSum(reduction="sum"))
    assert max_weight_difference(plain, model) <= TOLERANCE


def _padded_sequences(samples=48, steps=7, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, steps + 1, size=samples)
    tokens = rng.integers(1, 20, size=(samples, steps))
    tokens[np.arange(steps)[None, :] >= lengths[:, None]] = 0
    targets = rng.normal(size=(samples, steps, 1)).astype("float32")
    return tokens.astype("int32"), targets


def _masked_lstm(model_class, **kwargs):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((None,), dtype="int32")
    embedded = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
    hidden = keras.layers.LSTM(5, return_sequences=True)(embedded)
    outputs = keras.layers.Dense(1)(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


# Epochs -----------------------------------------------------------------

@pytest.mark.parametrize("repeated", [False, True])
@pytest.mark.parametrize("steps_per_execution", [2, 3])
def test_executions_of_several_steps_equal_the_large_batch(
        repeated, steps_per_execution):
    # 13 micro-batches per epoch: executions end inside windows, and the
    # epoch's last execution is shorter. (Keras 2 itself refuses data of
    # unknown length with steps_per_execution > 1.)
    x, y = regression_data(samples=100)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    fit_kwargs = {}
    if repeated:
        dataset = dataset.repeat()
        fit_kwargs = {"steps_per_epoch": 13}
    plain = mlp(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse",
                  steps_per_execution=steps_per_execution)
    model.fit(dataset, epochs=2, verbose=0, **fit_kwargs)
    assert iterations(model) == 8
    assert max_weight_difference(plain, model) <= TOLERANCE


# Distribution -----------------------------------------------------------

def test_several_workers_are_refused_by_name():
    # One worker is enough to build the strategy; Keras 2 is not run with
    # several.
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    x, y = regression_data()
    with strategy.scope():
        model = mlp(AccumulatingModel, n_gradients=4)
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="MultiWorkerMirroredStrategy"):
        model.fit(x, y, batch_size=8, verbose=0)


# Mixed precision ----------------------------------------------------------

def _under_mixed_float16(function, *args, **kwargs):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        return function(*args, **kwargs)
    finally:
        keras.mixed_precision.set_global_policy("float32")


def test_a_legacy_optimizer_under_mixed_float16_equals_the_mixed_large_batch():
    # The new optimizers' cases are test_mixed_precision.py's; a legacy one
    # under replicas is refused (test below).
    name = "legacy_sgd_momentum"
    x, y = regression_data(samples=96)
    plain, model = _under_mixed_float16(fit_both, mlp, OPTIMIZERS[name], x,
                                        y, 8, 4)
    assert isinstance(model.optimizer,
                      keras.mixed_precision.LossScaleOptimizer)
    assert iterations(model) == iterations(plain) == 6
    # float16 rounds the large batch's own gradient: its distance from
    # float32 sets the scale of "equal". A gradient left scaled, or scaled
    # twice, misses it by orders of magnitude.
    float32_plain, _ = fit_both(mlp, OPTIMIZERS[name], x, y, 8, 4)
    rounding = max_weight_difference(plain, float32_plain)
    assert max_weight_difference(plain, model) <= 2 * rounding + 1e-6
    assert float(model.optimizer.loss_scale) == float(plain.optimizer.loss_scale)


# Saving and resuming ------------------------------------------------------

SETTINGS = [
    {"n_gradients": {0: 2, 3: 4}, "flush_each_epoch": False,
     "accumulator_dtype": "float64"},
    {"n_gradients": 1},  # the defaults
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_keras_file_keeps_the_settings(settings, tmp_path):
    model = mlp(AccumulatingModel, **settings)
    model.compile(optimizer="adam", loss="mse")
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, AccumulatingModel)
    assert loaded.n_gradients == settings["n_gradients"]
    assert loaded.flush_each_epoch is settings.get("flush_each_epoch", True)
    assert loaded.accumulator_dtype == settings.get("accumulator_dtype",
                                                    "float32")
    assert max_weight_difference(model, loaded) == 0.0


@pytest.mark.parametrize("settings", SETTINGS)
def test_clone_keeps_the_class_and_settings(settings):
    model = mlp(AccumulatingModel, **settings)
    clone = keras.models.clone_model(model)
    assert isinstance(clone, AccumulatingModel)
    assert clone.n_gradients == settings["n_gradients"]
    assert clone.flush_each_epoch is settings.get("flush_each_epoch", True)


class _Wide(AccumulatingModel):
    """A functional subclass with a constructor of its own."""

    def __init__(self, units, **kwargs):
        inputs = keras.Input((6,))
        outputs = keras.layers.Dense(units)(inputs)
        super().__init__(inputs=inputs, outputs=outputs, **kwargs)
        self.units = units

    def get_config(self):
        return {"units": self.units, "n_gradients": self.n_gradients}

    @classmethod
    def from_config(cls, config):
        return cls(**config)


def test_functional_subclass_with_its_own_constructor_round_trips(tmp_path):
    model = _Wide(5, n_gradients=3)
    model.compile(optimizer="adam", loss="mse")
    path = str(tmp_path / "wide.keras")
    model.save(path)
    loaded = keras.models.load_model(path, custom_objects={"_Wide": _Wide})
    assert isinstance(loaded, _Wide)
    assert loaded.units == 5 and loaded.n_gradients == 3
    assert max_weight_difference(model, loaded) == 0.0


def _train_micro_batches(model, x, y, start, stop):
    for i in range(start, stop):
        model.train_on_batch(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])


def test_files_that_cannot_hold_an_open_window_warn(tmp_path):
    x, y = regression_data(samples=80)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="adam", loss="mse")
    _train_micro_batches(model, x, y, 0, 2)
    for name in ("w.h5", "w.weights.h5"):
        with pytest.warns(UserWarning, match="apply_open_window"):
            model.save_weights(str(tmp_path / name))
    for name in ("model.keras", "model.h5", "saved_model"):
        with pytest.warns(UserWarning, match="apply_open_window"):
            model.save(str(tmp_path / name))
    model.apply_open_window()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.save_weights(str(tmp_path / "w2.h5"))
        model.save(str(tmp_path / "model2.keras"))


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("file_format", ["h5", "json", "model_checkpoint"])
def test_h5_and_json_round_trips_keep_the_class_and_settings(
        settings, file_format, tmp_path):
    # Keras 2 writes the plain class name into `.h5` files and JSON, and a
    # name it cannot find made `model_from_json` return the name itself.
    x, y = regression_data(samples=32)
    model = mlp(AccumulatingModel, **settings)
    model.compile(optimizer="adam", loss="mse")
    if file_format == "model_checkpoint":
        path = str(tmp_path / "checkpoint.h5")
        model.fit(x, y, batch_size=8, epochs=1, verbose=0,
                  callbacks=[keras.callbacks.ModelCheckpoint(path)])
        loaded = keras.models.load_model(path)
    elif file_format == "h5":
        model.save(str(tmp_path / "model.h5"))
        loaded = keras.models.load_model(str(tmp_path / "model.h5"))
    else:
        loaded = keras.models.model_from_json(model.to_json())
        loaded.set_weights(model.get_weights())
    assert isinstance(loaded, AccumulatingModel)
    assert loaded.n_gradients == settings["n_gradients"]
    assert loaded.flush_each_epoch is settings.get("flush_each_epoch", True)
    assert loaded.accumulator_dtype == settings.get("accumulator_dtype",
                                                    "float32")
    assert max_weight_difference(model, loaded) == 0.0


@pytest.mark.parametrize("loss_scaling", [False, True])
def test_legacy_optimizers_under_replicas_are_refused_with_the_fix(
        loss_scaling, two_replicas):
    # Under two replicas a legacy optimizer weighed the replicas' window
    # gradients unlike one device where the last micro-batch split
    # unevenly (97 samples: 3.0e-2 from one device; the new SGD: 3e-8).
    x, y = regression_data(samples=97)
    optimizer = keras.optimizers.legacy.SGD(0.1)
    if loss_scaling:
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=optimizer, loss="mse")
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"tf\.keras\.optimizers\.SGD"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert max(float(np.max(np.abs(a - b)))
               for a, b in zip(before, model.get_weights())) == 0.0


def test_nadam_under_replicas_is_named_and_adam_is_not(two_replicas):
    # Keras 2's Nadam advances its `_u_product` once for each traced copy:
    # under two replicas plain Keras lands away from one device too.
    x, y = regression_data(samples=64)

    def train(model_class, optimizer, strategy=None, **settings):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = mlp(model_class, **settings)
            model.compile(optimizer=optimizer, loss="mse")
        model.set_weights(mlp(keras.Model).get_weights())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(x, y, batch_size=8 if settings else 32, epochs=1,
                      shuffle=False, verbose=0)
        return model, [str(w.message) for w in caught
                       if "replicas" in str(w.message)]

    one_device, _ = train(keras.Model, keras.optimizers.Nadam(0.01))
    plain, _ = train(keras.Model, keras.optimizers.Nadam(0.01), two_replicas)
    assert max_weight_difference(one_device, plain) > 0.0
    _, named = train(AccumulatingModel, keras.optimizers.Nadam(0.01),
                     two_replicas, n_gradients=4)
    assert len(named) == 1 and "Nadam" in named[0], named
    adam, named = train(AccumulatingModel, keras.optimizers.Adam(0.01),
                        two_replicas, n_gradients=4)
    plain_adam, _ = train(keras.Model, keras.optimizers.Adam(0.01))
    assert named == []
    assert max_weight_difference(plain_adam, adam) <= TOLERANCE


def test_legacy_optimizers_on_one_device_stay_exact():
    x, y = regression_data(samples=97)
    plain, model = fit_both(mlp, OPTIMIZERS["legacy_sgd_momentum"], x, y, 8, 4)
    assert iterations(model) == iterations(plain)
    assert max_weight_difference(plain, model) <= TOLERANCE


def _histories(build, loss, x, y, make_optimizer, micro_batch=8,
               callbacks=None):
    """Epoch losses of plain Keras 2 on 4*b and of windows of 4 x b."""
    plain = build(keras.Model)
    plain.compile(optimizer=make_optimizer(), loss=loss)
    expected = plain.fit(x, y, batch_size=4 * micro_batch, epochs=2,
                         shuffle=False, verbose=0)
    model = build(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=make_optimizer(), loss=loss)
    model.set_weights(build(keras.Model).get_weights())
    history = model.fit(x, y, batch_size=micro_batch, epochs=2,
                        shuffle=False, verbose=0, callbacks=callbacks)
    assert max_weight_difference(plain, model) <= TOLERANCE
    return expected.history["loss"], history.history["loss"]


def test_epoch_loss_of_masked_sequences_is_the_large_batch_loss():
    x, y = _padded_sequences()
    expected, logged = _histories(_masked_lstm, "mse", x, y,
                                  OPTIMIZERS["sgd"], micro_batch=6)
    np.testing.assert_allclose(logged, expected, rtol=1e-5)


def _tagger(model_class, **kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5, 3))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    return model_class(inputs=inputs, outputs=keras.layers.Dense(4)(hidden),
                       **kwargs)


def test_a_micro_batch_with_every_label_ignored_logs_no_nan():
    # Keras 2 divides a micro-batch whose labels are all ignored by zero
    # valid labels; the large batch around it has valid labels.
    rng = np.random.default_rng(5)
    x = rng.normal(size=(64, 5, 3)).astype("float32")
    y = rng.integers(0, 4, size=(64, 5)).astype("int32")
    y[8:16] = -1  # the second micro-batch of every first window
    y[40:48] = -1
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      ignore_class=-1)
    expected, logged = _histories(
        _tagger, loss, x, y, OPTIMIZERS["adam"],
        callbacks=[keras.callbacks.TerminateOnNaN()])
    assert len(logged) == 2 and np.all(np.isfinite(logged))
    np.testing.assert_allclose(logged, expected, rtol=1e-5)


@pytest.mark.parametrize("name", ["adam", "sgd_decay", "legacy_adam"])
def test_a_skipped_window_counts_in_iterations_like_a_skipped_step(name):
    # Keras 2's LossScaleOptimizer adds 1 to `iterations` when it skips a
    # step, so schedules and Adam's bias correction move on: a window
    # skipped for the same overflow must too.
    make_optimizer = {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "sgd_decay": lambda: keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.05, 1, 0.7)),
        "legacy_adam": lambda: keras.optimizers.legacy.Adam(0.01),
    }[name]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    y[5, 0] = 1e4  # overflows the large batch of 16 at the default scale

    keras.mixed_precision.set_global_policy("mixed_float16")
    plain = _tanh_regression(keras.Model)
    plain.compile(optimizer=make_optimizer(), loss="mse")
    plain.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    model = _tanh_regression(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=make_optimizer(), loss="mse")
    model.set_weights(_tanh_regression(keras.Model).get_weights())
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    assert model.skipped_windows >= 1
    assert iterations(model) == iterations(plain) == 8
    assert float(model.optimizer.loss_scale) == float(
        plain.optimizer.loss_scale)
    assert max_weight_difference(plain, model) <= 1e-3


def test_a_skipped_window_is_no_update_for_the_signal():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6)).astype("float32")
    y = rng.normal(size=(16, 3)).astype("float32")
    y[1, 0] = 1e4
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")

    class Signals(keras.callbacks.Callback):
        applied = []

        def on_train_batch_end(self, batch, logs=None):
            self.applied.append(self.model.update_applied)

    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[Signals()])
    assert model.skipped_windows == 1
    assert iterations(model) == 1  # the skip, counted as Keras 2 counts it
    assert Signals.applied == [False, False, False, False]


def _keras_3_or_skip():
    other = pytest.importorskip("keras")
    if other.__version__.startswith("2."):
        pytest.skip("no Keras 3 in this environment")
    return other


class _Holder(keras.layers.Layer):
    """A Keras 2 layer holding a Keras 3 layer in a dict attribute."""

    def __init__(self, foreign, **kwargs):
        super().__init__(**kwargs)
        self.parts = {"inner": foreign}
        self.own = keras.layers.Dense(3)

    def call(self, inputs):
        return self.own(inputs) + self.parts["inner"](inputs)


@pytest.mark.parametrize("placement", ["functional_graph", "dict_attribute"])
def test_keras_3_layers_anywhere_are_refused_by_name(placement):
    other = _keras_3_or_skip()
    inputs = keras.Input((6,))
    if placement == "functional_graph":
        # Keras 2 turns it into op layers holding its variables.
        hidden = keras.layers.Dense(8)(inputs)
        outputs = other.layers.Dense(3, name="foreign")(hidden)
        named = "tf.nn.bias_add"
    else:
        outputs = _Holder(other.layers.Dense(3), name="holder")(inputs)
        named = "holder.parts['inner']"
    model = AccumulatingModel(inputs=inputs, outputs=outputs, n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = regression_data(samples=16)
    before = model.get_weights()
    with pytest.raises(ValueError, match="another Keras") as error:
        model.fit(x, y, batch_size=4, verbose=0)
    assert named in str(error.value)
    assert all(np.array_equal(a, b)
               for a, b in zip(before, model.get_weights()))


def test_window_from_noise_scale_moves_a_legacy_optimizers_learning_rate():
    # The linear regression of test_noise_scale.py, learning rate 1e-4: the
    # noise scale grows as the loss falls, and the window and the learning
    # rate ("linear") follow it, as test_window_from_noise_scale.py checks
    # with Keras 2's optimizers; a legacy one keeps its learning rate among
    # its hyperparameters.
    x, y = _linear_data(8192)
    model = _linear_model(n_gradients=2, measure_noise_scale=True)
    # Many steps per execution: thousands of micro-batches, each costing
    # Python's overhead otherwise.
    model.compile(optimizer=keras.optimizers.legacy.SGD(1e-4), loss="mse",
                  steps_per_execution=64)
    history = model.fit(x, y, batch_size=4, epochs=3, verbose=0, callbacks=[
        WindowFromNoiseScale(learning_rate="linear")]).history
    for noise, window, rate in zip(history["smoothed_noise_scale"],
                                   history["window_n_gradients"],
                                   history["window_learning_rate"]):
        assert window == 2 ** round(np.log2(noise / 4))
        assert rate == pytest.approx(1e-4 * window / 2, rel=1e-5)
    assert history["window_n_gradients"][-1] > 2
    assert model.n_gradients == history["window_n_gradients"][-1]
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(
        history["window_learning_rate"][-1], rel=1e-5)


@pytest.mark.parametrize("later_fit", [False, True],
                         ids=["first_fit", "later_fit"])
def test_window_from_noise_scale_scales_a_legacy_schedule_as_the_large_batch(
        later_fit):
    # The window goes from 2 to 4 after the first epoch: the "linear" rule
    # doubles the decaying schedule of a legacy optimizer from there, and
    # plain Keras 2 with the large batch (8, then 16) and the schedule
    # doubled from the same update agrees (test_window_from_noise_scale.py
    # with Keras 2's optimizers). Added in a later fit(), the rule reaches
    # the step the first one traced.
    def decaying():
        return keras.optimizers.schedules.ExponentialDecay(0.05, 32, 0.5)

    x, y = regression_data(samples=512, features=4, outputs=1)
    model = _linear_model(n_gradients=2, measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.legacy.SGD(decaying(),
                                                        momentum=0.9),
                  loss="mse")
    if later_fit:
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    history = model.fit(x, y, batch_size=4, epochs=2, shuffle=False,
                        verbose=0, callbacks=[WindowFromNoiseScale(
                            min_n_gradients=4, max_n_gradients=4,
                            learning_rate="linear")]).history
    start = 128 if later_fit else 64
    reference = _linear_model(keras.Model)
    reference.compile(optimizer=keras.optimizers.legacy.SGD(
        ScaledFrom(decaying(), 2.0, start), momentum=0.9), loss="mse")
    reference.fit(x, y, batch_size=8, epochs=start // 64, shuffle=False,
                  verbose=0)
    reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == start + 32
    assert int(reference.optimizer.iterations) == start + 32
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert history["window_learning_rate"][0] == pytest.approx(
        2 * float(decaying()(start)), rel=1e-6)


def test_data_of_unknown_length_gets_no_update_without_data():
    # At the end of a Python generator, Keras 2 runs its train function once
    # more without data: that run still counts an update and applies
    # AdamW's decoupled weight decay (so plain Keras strays from its own
    # large batch, 0.0066 here). The window applies nothing without data.
    x, y = regression_data(samples=48)
    make_optimizer = lambda: keras.optimizers.AdamW(0.05, weight_decay=0.1)

    def batches(size):
        return ((x[i:i + size], y[i:i + size]) for i in range(0, 48, size))

    reference = mlp(keras.Model)
    start = reference.get_weights()
    reference.compile(optimizer=make_optimizer(), loss="mse")
    strays = mlp(keras.Model)
    strays.set_weights(start)
    strays.compile(optimizer=make_optimizer(), loss="mse")
    model = mlp(AccumulatingModel, n_gradients=2)
    model.set_weights(start)
    model.compile(optimizer=make_optimizer(), loss="mse")
    for _ in range(2):  # epochs, each a fresh generator
        reference.fit(x, y, batch_size=16, shuffle=False, verbose=0)
        strays.fit(batches(16), verbose=0)
        model.fit(batches(8), verbose=0)
    assert iterations(reference) == iterations(model) == 6
    assert iterations(strays) == 8  # the plain stray this test guards
    assert max_weight_difference(strays, reference) > 1e-3
    assert max_weight_difference(model, reference) <= TOLERANCE
