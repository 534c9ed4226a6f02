"""Window controls: n_gradients by epoch, the update signal, accumulator dtype.

Schedules are compared with plain Keras taking the matching large batches,
the signal with the optimizer's update count.
"""

import warnings

import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model import accumulating
from backends import keras_2_too
from backends import keras_3_only
from backends import ON_TORCH
from backends import not_on_jax
from helpers import keras
from helpers import iterations, max_weight_difference, mlp, regression_data
from helpers import skip_unless_executions_stop_cleanly

pytestmark = keras_2_too

# Keras 2's LossScaleOptimizer counts a skipped step in `iterations`
# (tests/test_keras2.py checks windows skipped there).
_SKIPPED_STEP_NOT_COUNTED = keras_3_only("a skipped step left uncounted")

MICRO_BATCH = 8


def _adam():
    return keras.optimizers.Adam(0.02)


# n_gradients as an epoch schedule -----------------------------------------


def test_schedule_trains_each_epoch_like_its_large_batch():
    # 80 samples: epoch 0 in windows of 1 (before the first key), epoch 1
    # of 2, epochs 2 and 3 of 4 (the last window of each epoch is short).
    x, y = regression_data(samples=80)
    schedule = {1: 2, 2: 4}
    model = mlp(AccumulatingModel, n_gradients=schedule)
    model.compile(optimizer=_adam(), loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=4, shuffle=False,
              verbose=0)

    plain = mlp(keras.Model)
    plain.compile(optimizer=_adam(), loss="mse")
    for n in (1, 2, 4, 4):
        plain.fit(x, y, batch_size=MICRO_BATCH * n, epochs=1, shuffle=False,
                  verbose=0)
    assert iterations(model) == iterations(plain) == 10 + 5 + 3 + 3
    assert max_weight_difference(model, plain) <= 1e-5
    assert model.n_gradients == schedule


def test_schedule_change_waits_for_the_window_carried_over():
    # flush_each_epoch=False, 10 micro-batches per epoch: epoch 0 in windows
    # of 4 leaves 2 open; it still closes at 4, then windows of 2 follow.
    x, y = regression_data(samples=10 * MICRO_BATCH)
    model = mlp(AccumulatingModel, n_gradients={0: 4, 1: 2},
                flush_each_epoch=False)
    model.compile(optimizer=_adam(), loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False,
              verbose=0)

    stream_x, stream_y = np.concatenate([x, x]), np.concatenate([y, y])
    window_ends = [4, 8, 12, 14, 16, 18, 20]  # in micro-batches
    plain = mlp(keras.Model)
    plain.compile(optimizer=_adam(), loss="mse")
    start = 0
    for end in window_ends:
        rows = slice(start * MICRO_BATCH, end * MICRO_BATCH)
        plain.train_on_batch(stream_x[rows], stream_y[rows])
        start = end
    assert iterations(model) == iterations(plain) == len(window_ends)
    assert max_weight_difference(model, plain) <= 1e-5


def test_fit_resumed_at_a_later_epoch_takes_that_epochs_length():
    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, n_gradients={0: 1, 2: 4})
    model.compile(optimizer=_adam(), loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=3, initial_epoch=2,
              shuffle=False, verbose=0)
    assert iterations(model) == 2


@pytest.mark.parametrize("schedule, named", [
    ({}, "at least one epoch"),
    ({-1: 2}, "key -1"),
    ({"2": 2}, "key '2'"),
    ({1.0: 2}, "key 1.0"),
    ({True: 2}, "key True"),
    ({0: 0}, "0: 0"),
    ({0: 2, 3: 1.5}, "3: 1.5"),
    ({0: 2, 3: None}, "3: None"),
])
def test_bad_schedule_is_refused_by_entry(schedule, named):
    with pytest.raises(ValueError, match="n_gradients") as error:
        mlp(AccumulatingModel, n_gradients=schedule)
    assert named in str(error.value)


def test_schedule_and_dtype_survive_save_load_and_clone(tmp_path):
    schedule = {0: 2, 3: 8}
    model = mlp(AccumulatingModel, n_gradients=schedule,
                accumulator_dtype="bfloat16")
    model.compile(optimizer=_adam(), loss="mse")
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    clone = keras.models.clone_model(model)
    for copy in (loaded, clone):
        assert copy.n_gradients == schedule
        assert copy.accumulator_dtype == "bfloat16"
    assert model.get_config()["n_gradients"] == schedule


def test_accumulating_takes_a_schedule():
    x, y = regression_data(samples=32)
    model = accumulating(mlp(keras.Model), n_gradients={1: 4})
    model.compile(optimizer=_adam(), loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False,
              verbose=0)
    assert iterations(model) == 4 + 1


# The update signal ----------------------------------------------------------


class _RecordUpdates(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.marked = []

    def on_epoch_begin(self, epoch, logs=None):
        self.marked.append([])

    def on_train_batch_end(self, batch, logs=None):
        if self.model.update_applied:
            self.marked[-1].append(batch)


@pytest.mark.parametrize("n_gradients, expected", [
    (4, [[3, 7, 9], [3, 7, 9]]),
    (1, [list(range(10))] * 2),
    ({1: 4}, [list(range(10)), [3, 7, 9]]),
])
def test_update_signal_marks_the_last_micro_batch_of_each_window(
        n_gradients, expected):
    x, y = regression_data(samples=10 * MICRO_BATCH)
    model = mlp(AccumulatingModel, n_gradients=n_gradients)
    model.compile(optimizer=_adam(), loss="mse")
    record = _RecordUpdates()
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False,
              verbose=0, callbacks=[record])
    assert record.marked == expected
    assert sum(map(len, record.marked)) == iterations(model)


def test_update_signal_per_execution_marks_executions_with_an_update():
    # steps_per_execution=2: callbacks see micro-batches 1, 3, 5, 7, 9;
    # windows of 3 end at micro-batches 2, 5, 8 and 9 (the epoch's end).
    skip_unless_executions_stop_cleanly(2)
    x, y = regression_data(samples=10 * MICRO_BATCH)
    model = mlp(AccumulatingModel, n_gradients=3)
    model.compile(optimizer=_adam(), loss="mse", steps_per_execution=2)
    record = _RecordUpdates()
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[record])
    assert record.marked == [[3, 5, 9]]
    assert iterations(model) == 4


@_SKIPPED_STEP_NOT_COUNTED
def test_float16_accumulator_under_loss_scaling_skips_the_overflow():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = regression_data(samples=8 * MICRO_BATCH)
    y[4 * MICRO_BATCH + 2] = 1e4  # overflows the scaled float16 backward
    model = mlp(AccumulatingModel, n_gradients=4, accumulator_dtype="float16")
    model.compile(optimizer=_adam(), loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert model.skipped_windows == 1
    assert iterations(model) == 1
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


@_SKIPPED_STEP_NOT_COUNTED
def test_update_signal_does_not_mark_a_window_skipped_for_overflow():
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = regression_data(samples=10 * MICRO_BATCH)
    y[5 * MICRO_BATCH + 1] = 1e4  # the second window overflows float16
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=_adam(), loss="mse")
    record = _RecordUpdates()
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[record])
    assert model.skipped_windows == 1
    assert record.marked == [[3, 9]]
    assert iterations(model) == 2


# The accumulators' dtype ----------------------------------------------------


@pytest.mark.parametrize("dtype, tolerance", [
    pytest.param("float64", 1e-5, marks=not_on_jax(
        "float64 on JAX needs jax_enable_x64, refused otherwise "
        "(tests/test_backends.py)")),
    ("float32", 1e-5), ("bfloat16", 3e-2), ("float16", 3e-3),
])
def test_accumulator_dtype_sets_memory_and_stays_close(dtype, tolerance):
    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, n_gradients=4, accumulator_dtype=dtype)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False,
              verbose=0)
    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x, y, batch_size=4 * MICRO_BATCH, epochs=2, shuffle=False,
              verbose=0)
    parameters = sum(int(np.prod(w.shape)) for w in model.trainable_weights)
    assert model.accumulator_bytes == parameters * np.dtype(
        "float16" if dtype == "bfloat16" else dtype).itemsize
    assert max_weight_difference(model, plain) <= tolerance
    if dtype in ("float64", "float32"):
        return
    # A narrow sum is not the float32 one: the tolerance is not slack.
    assert max_weight_difference(model, plain) > 1e-7


def _float64_mlp(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,), dtype="float64")
    hidden = keras.layers.Dense(8, activation="tanh", dtype="float64",
                                name="wide_hidden")(inputs)
    outputs = keras.layers.Dense(3, dtype="float64",
                                 name="wide_output")(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


@not_on_jax("float64 weights on JAX need jax_enable_x64")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_float64_weights_are_summed_in_float64_or_named(dtype):
    # float32 sums round a float64 model's window to float32's precision
    # (TensorFlow: 3.6e-9 from the float64 large batch, against 1.1e-16
    # with float64 sums): fit() says so and names the argument. Keras on
    # PyTorch computes the loss in float32 (keras 3.15.1, even a loss built
    # with dtype="float64"), so its own large batch lands 2e-7 from the
    # float64 gradient: there the window can only match it to float32.
    x, y = (array.astype("float64") for array in regression_data(64))
    plain = _float64_mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model = _float64_mlp(AccumulatingModel, n_gradients=4,
                         accumulator_dtype=dtype)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=4 * MICRO_BATCH, epochs=2, shuffle=False,
              verbose=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False,
                  verbose=0)
    named = [str(w.message) for w in caught
             if "accumulator_dtype='float64'" in str(w.message)]
    difference = max_weight_difference(model, plain)
    if dtype == "float64":
        assert not named
        assert difference <= (1e-6 if ON_TORCH else 1e-12)
    else:
        assert len(named) == 1
        assert "['wide_hidden', 'wide_output']" in named[0]
        assert 1e-12 < difference <= 1e-6


@pytest.mark.parametrize("dtype", ["int32", "float8_e4m3fn", None, "fp16"])
def test_bad_accumulator_dtype_is_refused(dtype):
    with pytest.raises(ValueError, match="accumulator_dtype"):
        mlp(AccumulatingModel, n_gradients=2, accumulator_dtype=dtype)


def test_float16_accumulator_overflow_is_skipped_and_counted():
    # No loss scaling: sums of micro-batch gradients above 65504 overflow
    # float16; that window must be skipped and counted, never applied.
    x, y = regression_data(samples=8 * MICRO_BATCH)
    y[4 * MICRO_BATCH:8 * MICRO_BATCH] = 5e3  # the second window
    model = mlp(AccumulatingModel, n_gradients=4, accumulator_dtype="float16")
    model.compile(optimizer=keras.optimizers.SGD(1e-6), loss="mse")
    history = model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False,
                        verbose=0)
    assert model.skipped_windows == 1
    assert history.history["skipped_windows"] == [1]
    assert iterations(model) == 1
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_update_signal_with_data_of_unknown_length_marks_the_epochs_end():
    # A generator: Keras learns the epoch ended only when it finds no data,
    # and the short last window is applied then, after the last batch.
    x, y = regression_data(samples=10 * MICRO_BATCH)

    def batches():
        for start in range(0, len(x), MICRO_BATCH):
            yield x[start:start + MICRO_BATCH], y[start:start + MICRO_BATCH]

    class RecordEpochEnd(_RecordUpdates):
        def on_epoch_end(self, epoch, logs=None):
            self.at_epoch_end = self.model.update_applied

    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=_adam(), loss="mse")
    record = RecordEpochEnd()
    model.fit(batches(), epochs=1, verbose=0, callbacks=[record])
    assert record.marked == [[3, 7]]
    assert record.at_epoch_end
    assert iterations(model) == 3
