"""Windows and `fit()`'s epochs: executions, validation, stops, EMA, reruns."""

import csv

import numpy as np
import pytest

from accum_model import AccumulatingModel
from backends import keras_2_too
from backends import keras_3_only
from helpers import keras
from helpers import iterations
from helpers import max_weight_difference
from helpers import mlp
from helpers import numpy_of
from helpers import regression_data
from helpers import skip_unless_executions_stop_cleanly
from helpers import windows_reference

pytestmark = keras_2_too


def _micro_batches(samples, size=8):
    return [list(range(i, min(i + size, samples)))
            for i in range(0, samples, size)]


class WindowSizes(keras.callbacks.Callback):
    """Records how many micro-batches each update took."""

    def __init__(self):
        super().__init__()
        self.sizes, self._seen, self._last = [], 0, 0

    def on_train_batch_end(self, batch, logs=None):
        self._seen += 1
        now = int(self.model.optimizer.iterations.numpy())
        if now != self._last:
            self.sizes.append(self._seen)
            self._seen, self._last = 0, now


def _refused_by_this_keras(model, x, y, **fit_kwargs):
    """True, after checking the error, where Keras cannot stop cleanly."""
    from accum_model._chooser import adapter

    if adapter.executions_stop_cleanly_at_end_of_data():
        return False
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(x, y, **fit_kwargs)
    assert iterations(model) == 0
    return True


@keras_3_only("Keras 2 runs steps_per_epoch micro-batches, not whole "
              "executions (tests/test_keras2.py)")
def test_steps_per_execution_that_does_not_divide_the_epoch():
    skip_unless_executions_stop_cleanly(3)
    # steps_per_epoch=10 with executions of 3: Keras runs 12 micro-batches.
    x, y = regression_data(samples=128)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                  steps_per_execution=3)
    if _refused_by_this_keras(model, x, y, batch_size=8, verbose=0):
        return
    model.fit(x, y, batch_size=8, steps_per_epoch=10, epochs=1,
              shuffle=False, verbose=0)
    micro = _micro_batches(128)
    windows = [sum(micro[i:i + 4], []) for i in (0, 4, 8)]
    plain = windows_reference(x, y, windows, keras.optimizers.SGD(0.1))
    assert iterations(model) == 3
    assert max_weight_difference(plain, model) <= 1e-6


def test_steps_per_execution_with_an_epoch_shorter_than_its_executions():
    skip_unless_executions_stop_cleanly(3)
    # 10 micro-batches of data, executions of 3: Keras runs 3, 3, 3, 1.
    x, y = regression_data(samples=80)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                  steps_per_execution=3)
    if _refused_by_this_keras(model, x, y, batch_size=8, verbose=0):
        return
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    micro = _micro_batches(80)
    epoch = [sum(micro[i:i + 4], []) for i in (0, 4, 8)]
    plain = windows_reference(x, y, epoch * 2, keras.optimizers.SGD(0.1))
    assert iterations(model) == 6
    assert max_weight_difference(plain, model) <= 1e-6


class StopAt(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            self.model.stop_training = True


@pytest.mark.parametrize("as_callback_list", [False, True])
def test_validation_sees_the_epochs_last_window(as_callback_list):
    x, y = regression_data(samples=100)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    callbacks = [StopAt(4)]
    if as_callback_list:
        callbacks = keras.callbacks.CallbackList(callbacks, add_history=True,
                                                model=model)
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                        verbose=0, validation_data=(x[:40], y[:40]),
                        callbacks=callbacks)
    assert iterations(model) == 2
    after = model.evaluate(x[:40], y[:40], verbose=0)
    np.testing.assert_allclose(history.history["val_loss"][-1], after,
                               rtol=1e-6)


def test_every_epoch_validates_after_its_window_with_a_callback_list():
    x, y = regression_data(samples=100)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    seen = []

    class Evaluate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((logs["val_loss"],
                         self.model.evaluate(x[:40], y[:40], verbose=0)))

    callbacks = keras.callbacks.CallbackList([Evaluate()], add_history=True,
                                            model=model)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              validation_data=(x[:40], y[:40]), callbacks=callbacks)
    assert iterations(model) == 8
    for validated, evaluated in seen:
        np.testing.assert_allclose(validated, evaluated, rtol=1e-6)


@pytest.mark.parametrize("flush_each_epoch", [True, False])
def test_ema_is_written_after_the_last_window(flush_each_epoch):
    x, y = regression_data(samples=80)

    def optimizer():
        return keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.5,
                                     ema_overwrite_frequency=None)

    model = mlp(AccumulatingModel, n_gradients=4,
                flush_each_epoch=flush_each_epoch)
    model.compile(optimizer=optimizer(), loss="mse")
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    micro = _micro_batches(80)
    if flush_each_epoch:
        windows = [sum(micro[i:i + 4], []) for i in (0, 4, 8)] * 3
    else:  # 30 micro-batches: 7 windows of 4, and 2 open at the end
        micro = micro * 3
        windows = [sum(micro[i:i + 4], []) for i in range(0, 30, 4)]
    plain = mlp(keras.Model)
    plain.compile(optimizer=optimizer(), loss="mse")
    for window in windows:
        plain.train_on_batch(x[window], y[window])
    plain.optimizer.finalize_variable_values(plain.trainable_variables)
    assert iterations(model) == len(windows)
    assert max_weight_difference(plain, model) <= 1e-6


def test_window_carried_over_is_applied_when_a_callback_stops_training():
    x, y = regression_data(samples=40)

    class StopAtEpochEnd(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    model = mlp(AccumulatingModel, n_gradients=4, flush_each_epoch=False)
    model.compile(optimizer=keras.optimizers.Adam(
        0.01, use_ema=True, ema_overwrite_frequency=None), loss="mse")
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[StopAtEpochEnd()])
    micro = _micro_batches(40)
    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.Adam(
        0.01, use_ema=True, ema_overwrite_frequency=None), loss="mse")
    for window in (sum(micro[:4], []), micro[4]):
        plain.train_on_batch(x[window], y[window])
    plain.optimizer.finalize_variable_values(plain.trainable_variables)
    assert iterations(model) == 2
    assert max_weight_difference(plain, model) <= 1e-6


def test_fit_stopped_mid_epoch_leaves_no_epoch_length_behind():
    x, y = regression_data(samples=100)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[StopAt(1)])
    assert iterations(model) == 1
    # train_on_batch windows are n_gradients long, whatever fit() left.
    for start in range(0, 64, 8):
        model.train_on_batch(x[start:start + 8], y[start:start + 8])
    assert iterations(model) == 3
    assert model._accumulation.open_micro_steps() == 0


def test_window_rebuilt_after_fit_forgets_the_epochs_length():
    x, y = regression_data(samples=128)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x[:100], y[:100], batch_size=8, epochs=1, shuffle=False,
              verbose=0)  # epochs of 13 micro-batches
    model.layers[1].trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    for start in range(0, 128, 8):
        model.train_on_batch(x[start:start + 8], y[start:start + 8])
    assert iterations(model) == 4
    assert model._accumulation.open_micro_steps() == 0


def test_n_gradients_changed_between_fits_takes_effect():
    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, n_gradients=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.n_gradients = 4
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    micro = _micro_batches(64)
    windows = ([sum(micro[i:i + 2], []) for i in range(0, 8, 2)]
               + [sum(micro[i:i + 4], []) for i in (0, 4)])
    plain = windows_reference(x, y, windows, keras.optimizers.SGD(0.1))
    assert iterations(model) == 6
    assert max_weight_difference(plain, model) <= 1e-6
    model.n_gradients = 1
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert iterations(model) == 14


def test_n_gradients_cannot_change_with_a_window_open():
    x, y = regression_data(samples=16)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x[:8], y[:8])
    with pytest.raises(ValueError, match="apply_open_window"):
        model.n_gradients = 2
    for bad in (0, 2.5, "2"):
        with pytest.raises(ValueError, match="n_gradients"):
            model.n_gradients = bad
    model.apply_open_window()
    model.n_gradients = 2
    assert model.n_gradients == 2


def test_accumulator_dtype_set_between_fits_builds_the_window_anew():
    x, y = regression_data(samples=32)
    model = mlp(AccumulatingModel, n_gradients=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    float32_bytes = model.accumulator_bytes
    model.accumulator_dtype = "bfloat16"
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert model.accumulator_dtype == "bfloat16"
    assert model.accumulator_bytes == float32_bytes // 2
    assert iterations(model) == 4
    model.train_on_batch(x[:8], y[:8])
    with pytest.raises(ValueError, match="apply_open_window"):
        model.accumulator_dtype = "float32"
    with pytest.raises(ValueError, match="accumulator_dtype"):
        model.accumulator_dtype = "int8"


def test_accumulating_an_accumulating_model_changes_its_settings_alike():
    from accum_model import accumulating

    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, n_gradients=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert accumulating(model, n_gradients=4) is model
    assert model.n_gradients == 4
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert iterations(model) == 4 + 2
    model.train_on_batch(x[:8], y[:8])
    with pytest.raises(ValueError, match="apply_open_window"):
        accumulating(model, n_gradients=2)
    assert model.n_gradients == 4


class _LossAtEpochEnd(keras.callbacks.Callback):
    """The mean squared error of all the data at each epoch's end, and the
    updates applied by then."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.losses, self.updates = [], []

    def on_epoch_end(self, epoch, logs=None):
        predictions = numpy_of(self.model(self.x, training=False))
        self.losses.append(float(np.mean((predictions - self.y) ** 2)))
        self.updates.append(iterations(self.model))


def test_an_epoch_in_which_no_window_ends_logs_its_micro_batches_loss(
        tmp_path):
    # 10 micro-batches an epoch, windows of 16 carried across epochs: no
    # window ends in epochs 0 and 2, so nothing moves the weights in them,
    # and their loss is that of all the data at the epoch's end. Before,
    # they logged 0.0, and EarlyStopping/ModelCheckpoint acted on it.
    x, y = regression_data(samples=80)
    model = mlp(AccumulatingModel, n_gradients=16, flush_each_epoch=False,
                measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    at_end = _LossAtEpochEnd(x, y)
    csv_path = tmp_path / "log.csv"
    history = model.fit(
        x, y, batch_size=8, epochs=4, shuffle=False, verbose=0,
        callbacks=[at_end, keras.callbacks.CSVLogger(csv_path)],
    ).history
    assert at_end.updates == [0, 1, 1, 3]
    assert len(history["loss"]) == 4
    np.testing.assert_allclose([history["loss"][k] for k in (0, 2)],
                               [at_end.losses[k] for k in (0, 2)], rtol=1e-5)
    assert min(history["loss"]) > 0.0
    # One noise scale per epoch: NaN where no window ended, so the list and
    # CSVLogger's column line up with the epochs.
    assert np.isnan(history["noise_scale"]).tolist() == [True, False, True,
                                                        False]
    with open(csv_path) as rows:
        rows = list(csv.DictReader(rows))
    assert [int(row["epoch"]) for row in rows] == [0, 1, 2, 3]
    np.testing.assert_allclose([float(row["loss"]) for row in rows],
                               history["loss"], rtol=1e-6)


@pytest.mark.parametrize("flush_each_epoch", [True, False])
def test_a_fit_shorter_than_one_window_logs_the_large_batchs_loss(
        flush_each_epoch):
    x, y = regression_data(samples=80)
    model = mlp(AccumulatingModel, n_gradients=16,
                flush_each_epoch=flush_each_epoch)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = _LossAtEpochEnd(x, y)
    before.set_model(model)
    before.on_epoch_end(0)
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                        verbose=0).history
    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain_history = plain.fit(x, y, batch_size=80, epochs=1, shuffle=False,
                              verbose=0).history
    assert iterations(model) == 1
    np.testing.assert_allclose(history["loss"], plain_history["loss"],
                               rtol=1e-5)
    np.testing.assert_allclose(history["loss"], before.losses, rtol=1e-5)
    assert max_weight_difference(plain, model) <= 1e-6


def test_callbacks_see_the_losses_history_keeps():
    # Windows longer than an epoch: a loss of 0.0 logged for the epochs
    # without a window end made EarlyStopping(monitor="loss") stop at once.
    x, y = regression_data(samples=80)
    model = mlp(AccumulatingModel, n_gradients=16, flush_each_epoch=False)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: seen.append(logs["loss"]))
    history = model.fit(x, y, batch_size=8, epochs=6, shuffle=False,
                        verbose=0, callbacks=[record]).history
    assert seen == history["loss"]
    assert min(seen) > 0.5, seen


@pytest.mark.parametrize("flush_each_epoch", [True, False])
def test_the_micro_batches_before_the_first_window_ends_log_their_loss(
        flush_each_epoch):
    # Keras's loss tracker is empty until a window ends: the progress bar
    # and the callbacks read 0.0 for the first n - 1 micro-batches.
    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, n_gradients=4,
                flush_each_epoch=flush_each_epoch)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain = mlp(keras.Model)
    plain.compile(loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(
            float(logs["loss"])))
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[record])
    # The loss of the micro-batches so far, as one batch, at the weights
    # before the first update.
    so_far = [plain.evaluate(x[:8 * k], y[:8 * k], batch_size=64, verbose=0)
              for k in (1, 2, 3)]
    np.testing.assert_allclose(seen[:3], so_far, rtol=1e-5)
    assert len(seen) == 16 and min(seen) > 0.0, seen
