"""`WindowFromNoiseScale`: the window follows the measured noise scale.

On the closed-form linear regression of test_noise_scale.py (B_noise known
at the start, growing as the loss falls), starting from the smallest
window: the window reaches the noise scale and then tracks it; the
learning-rate rules give their documented values; bad input is refused
before training.
"""

import contextlib
import math
import warnings

import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model import WindowFromNoiseScale
from accum_model import accumulating
from accum_model._chooser import adapter
from backends import ON_KERAS_2
from backends import ON_TORCH
from backends import keras_2_too
from helpers import ScaledFrom
from helpers import iterations
from helpers import keras
from helpers import numpy_of
from test_noise_scale import _linear_data
from test_noise_scale import _linear_model
from test_noise_scale import _reference_noise_scale

MICRO_BATCH = 4
# Many micro-steps per call of the step: the noise scale needs thousands of
# micro-batches, and each costs Python's overhead otherwise (Keras refuses
# more than one on PyTorch).
STEPS_PER_EXECUTION = 1 if ON_TORCH else 64

pytestmark = keras_2_too


def _fit(sizer, learning_rate=1e-4, epochs=5, model=None, x=None, y=None,
         optimizer=None, samples=8192, **fit_kwargs):
    if x is None:
        x, y = _linear_data(samples)
    model = model or _linear_model(n_gradients=2, measure_noise_scale=True)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(learning_rate),
                  loss="mse", steps_per_execution=STEPS_PER_EXECUTION)
    keras.utils.set_random_seed(0)
    history = model.fit(x, y, batch_size=MICRO_BATCH, epochs=epochs,
                        verbose=0, callbacks=[sizer], **fit_kwargs).history
    return model, history


def _power_of_two_nearest(value):
    return 2 ** round(math.log2(value))


def test_the_window_reaches_a_known_noise_scale():
    # Learning rate 0: every epoch measures the data set's B_noise at the
    # start, whose nearest window is 16 / 4 = 4 micro-batches.
    x, y = _linear_data()
    reference = _reference_noise_scale(x, y)
    model, history = _fit(WindowFromNoiseScale(), learning_rate=0.0,
                          epochs=3)
    expected = _power_of_two_nearest(reference / MICRO_BATCH)
    assert expected == 4
    assert history["window_n_gradients"] == [expected] * 3
    assert model.n_gradients == expected
    np.testing.assert_allclose(history["smoothed_noise_scale"][-1],
                               reference, rtol=0.15)


def test_the_window_tracks_a_growing_noise_scale():
    # The noise scale grows about 5x over 6 epochs as the loss falls; each
    # epoch's window (for the next epoch) stays within a factor of 2 of the
    # noise scale just measured, and the updates follow the windows.
    model, history = _fit(WindowFromNoiseScale(smoothing=0.0),
                          learning_rate=3e-4, epochs=6)
    measured = np.array(history["noise_scale"])
    windows = np.array(history["window_n_gradients"])
    assert measured[-1] > 2 * measured[0]
    assert windows[-1] > windows[0]
    ratio = windows * MICRO_BATCH / measured
    assert np.all((ratio >= 0.5) & (ratio <= 2.0)), ratio
    steps = len(_linear_data()[0]) // MICRO_BATCH
    expected_updates = steps // 2 + sum(steps // n for n in windows[:-1])
    assert iterations(model) == expected_updates


def test_smoothing_averages_the_logarithm():
    _, history = _fit(WindowFromNoiseScale(smoothing=0.5), epochs=3,
                      samples=2048)
    measured = history["noise_scale"]
    smoothed = history["smoothed_noise_scale"]
    assert smoothed[0] == pytest.approx(measured[0])
    assert smoothed[1] == pytest.approx(math.sqrt(measured[0] * measured[1]))
    assert smoothed[2] == pytest.approx(
        math.sqrt(smoothed[1] * measured[2]))


@pytest.mark.parametrize("rule", ["linear", "sqrt", "adascale"])
def test_learning_rate_rules_give_their_values(rule):
    start = 1e-4
    model, history = _fit(WindowFromNoiseScale(learning_rate=rule),
                          learning_rate=start, epochs=3, samples=2048)
    for window, noise, logged in zip(history["window_n_gradients"],
                                     history["smoothed_noise_scale"],
                                     history["window_learning_rate"]):
        scale = window / 2
        expected = {
            "linear": start * scale,
            "sqrt": start * math.sqrt(scale),
            "adascale": start * (1 + noise / (2 * MICRO_BATCH))
            / (1 + noise / (scale * 2 * MICRO_BATCH)),
        }[rule]
        assert logged == pytest.approx(expected, rel=1e-5)
    assert float(numpy_of(
        model.optimizer.learning_rate)) == pytest.approx(
            history["window_learning_rate"][-1], rel=1e-5)


def test_no_rule_leaves_the_learning_rate():
    model, history = _fit(WindowFromNoiseScale(), learning_rate=1e-4,
                          epochs=3, samples=2048)
    assert history["window_learning_rate"] == pytest.approx([1e-4] * 3)


@pytest.mark.parametrize("unresolved", [0.0, math.inf, math.nan])
def test_an_unresolved_epoch_leaves_the_window(unresolved):
    # 0 and inf are what an epoch logs when its windows could not resolve
    # the noise or the signal; NaN an epoch that measured nothing.
    sizer = WindowFromNoiseScale()
    model, history = _fit(sizer, learning_rate=0.0, epochs=1, samples=2048)
    smoothed = sizer.smoothed_noise_scale
    logs = {"noise_scale": unresolved}
    sizer.on_epoch_end(1, logs)
    assert model.n_gradients == history["window_n_gradients"][0] == 4
    assert sizer.smoothed_noise_scale == smoothed
    assert logs["window_n_gradients"] == 4
    assert logs["smoothed_noise_scale"] == smoothed


def test_the_bounds_hold():
    _, history = _fit(WindowFromNoiseScale(min_n_gradients=8,
                                           max_n_gradients=8),
                      learning_rate=0.0, epochs=2, samples=2048)
    assert history["window_n_gradients"] == [8, 8]


def test_its_logs_reach_callbacks_listed_before_it(tmp_path):
    path = tmp_path / "log.csv"
    x, y = _linear_data(2048)
    model = _linear_model(n_gradients=2, measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse",
                  steps_per_execution=STEPS_PER_EXECUTION)
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, verbose=0,
              callbacks=[keras.callbacks.CSVLogger(str(path)),
                         WindowFromNoiseScale()])
    header = path.read_text().splitlines()[0].split(",")
    assert {"smoothed_noise_scale", "window_n_gradients",
            "window_learning_rate"} <= set(header)


def test_a_batch_size_it_cannot_know_must_be_given():
    x, y = _linear_data(samples=64)

    def batches():
        for start in range(0, len(x), MICRO_BATCH):
            yield x[start:start + MICRO_BATCH], y[start:start + MICRO_BATCH]

    model = _linear_model(n_gradients=2, measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    with pytest.raises(ValueError, match="micro_batch_size"):
        model.fit(batches(), epochs=1, verbose=0,
                  callbacks=[WindowFromNoiseScale()])
    assert iterations(model) == 0
    history = model.fit(
        batches(), epochs=1, verbose=0,
        callbacks=[WindowFromNoiseScale(micro_batch_size=MICRO_BATCH)])
    measured = history.history["noise_scale"][0]
    assert model.n_gradients == min(64, max(2, _power_of_two_nearest(
        measured / MICRO_BATCH)))


@pytest.mark.parametrize("kwargs, name", [
    ({"min_n_gradients": 1}, "min_n_gradients"),
    ({"min_n_gradients": 8, "max_n_gradients": 4}, "max_n_gradients"),
    ({"max_n_gradients": 2.5}, "max_n_gradients"),
    ({"learning_rate": "cubic"}, "learning_rate"),
    ({"smoothing": 1.0}, "smoothing"),
    ({"micro_batch_size": 0}, "micro_batch_size"),
])
def test_bad_arguments_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        WindowFromNoiseScale(**kwargs)


def _refused_before_training(model, match, sizer=None, optimizer=None):
    x, y = _linear_data(samples=64)
    model.compile(optimizer=optimizer or keras.optimizers.SGD(0.01),
                  loss="mse")
    weights = model.get_weights()
    with pytest.raises(ValueError, match=match):
        model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, verbose=0,
                  callbacks=[sizer or WindowFromNoiseScale()])
    assert all(np.array_equal(a, b)
               for a, b in zip(weights, model.get_weights()))


def test_a_model_that_does_not_measure_is_refused():
    _refused_before_training(_linear_model(n_gradients=2),
                             "measure_noise_scale=True")


def test_a_plain_keras_model_is_refused():
    _refused_before_training(_linear_model(keras.Model),
                             "accumulating model")


def test_a_schedule_of_windows_is_refused():
    _refused_before_training(
        _linear_model(n_gradients={0: 2, 3: 4}, measure_noise_scale=True),
        "n_gradients itself")


def test_windows_kept_across_epochs_are_refused():
    _refused_before_training(
        _linear_model(n_gradients=2, measure_noise_scale=True,
                      flush_each_epoch=False), "flush_each_epoch=True")


def test_a_callable_learning_rate_with_a_rule_is_refused():
    # Keras 2's optimizers (TF 2.11+) turn a callable learning rate into a
    # variable, which a rule scales as a float; its legacy ones keep it.
    optimizers = keras.optimizers.legacy if ON_KERAS_2 else keras.optimizers
    _refused_before_training(
        _linear_model(n_gradients=2, measure_noise_scale=True),
        "LearningRateSchedule subclass",
        sizer=WindowFromNoiseScale(learning_rate="linear"),
        optimizer=optimizers.SGD(lambda: 0.01))


def _multi_optimizer():
    multi = getattr(keras.optimizers, "MultiOptimizer", None)
    if multi is None:
        pytest.skip("this Keras has no MultiOptimizer")
    return multi(keras.optimizers.OptimizerMap(
        keras.optimizers.SGD(0.01), {".*bias.*": keras.optimizers.SGD(0.1)}))


def test_a_rule_on_several_optimizers_is_refused_by_name():
    _refused_before_training(
        _linear_model(n_gradients=2, measure_noise_scale=True),
        "MultiOptimizer.*several optimizers.*learning_rate=None",
        sizer=WindowFromNoiseScale(learning_rate="linear"),
        optimizer=_multi_optimizer())


def test_several_optimizers_log_no_single_learning_rate():
    model, history = _fit(WindowFromNoiseScale(), epochs=2, samples=2048,
                          model=_linear_model(n_gradients=2,
                                              measure_noise_scale=True),
                          optimizer=_multi_optimizer())
    assert all(math.isnan(rate) for rate in history["window_learning_rate"])
    assert len(history["window_n_gradients"]) == 2


def test_a_schedule_runs_untouched_without_a_rule():
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-4, 100, 0.5)
    x, y = _linear_data(2048)
    model = accumulating(_linear_model(keras.Model), n_gradients=2,
                         measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.SGD(schedule), loss="mse",
                  steps_per_execution=STEPS_PER_EXECUTION)
    history = model.fit(x, y, batch_size=MICRO_BATCH, epochs=2, verbose=0,
                        callbacks=[WindowFromNoiseScale()]).history
    assert model.optimizer._learning_rate is schedule
    updates = iterations(model)
    assert history["window_learning_rate"][-1] == pytest.approx(
        float(numpy_of(schedule(updates))), rel=1e-6)
    assert isinstance(model, AccumulatingModel)


def _decaying():
    return keras.optimizers.schedules.ExponentialDecay(0.05, 32, 0.5)


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_rule_scales_a_schedule_as_the_large_batch(replicas, request):
    # The window goes from 2 to 4 after the first epoch (both bounds 4):
    # the "linear" rule doubles the decaying schedule from there, which
    # keeps running on the updates. Plain Keras with the large batch (8,
    # then 16) and the schedule doubled from the same update agrees.
    scope = (request.getfixturevalue("two_replicas").scope()
             if replicas == 2 else contextlib.nullcontext())
    x, y = _linear_data(samples=512)
    first_epoch_updates = len(x) // (2 * MICRO_BATCH)
    with scope:
        model = _linear_model(n_gradients=2, measure_noise_scale=True)
        model.compile(optimizer=keras.optimizers.SGD(_decaying(),
                                                     momentum=0.9),
                      loss="mse")
        history = model.fit(
            x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False,
            verbose=0, callbacks=[WindowFromNoiseScale(
                min_n_gradients=4, max_n_gradients=4,
                learning_rate="linear")]).history
    # Reading the rate and the scale converts no tensor through NumPy's
    # `__array__`, which NumPy 2 deprecates for torch's tensors.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapter.learning_rate.learning_rate_of(model.optimizer)
        model.optimizer.get_config()
    assert not [(w.filename, w.lineno, str(w.message)) for w in caught if "__array__" in str(w.message)]
    reference = _linear_model(keras.Model)
    reference.compile(optimizer=keras.optimizers.SGD(
        ScaledFrom(_decaying(), 2.0, first_epoch_updates), momentum=0.9),
        loss="mse")
    reference.fit(x, y, batch_size=2 * MICRO_BATCH, shuffle=False, verbose=0)
    reference.fit(x, y, batch_size=4 * MICRO_BATCH, shuffle=False, verbose=0)
    assert iterations(model) == iterations(reference) == (
        first_epoch_updates * 3 // 2)
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert history["window_learning_rate"][0] == pytest.approx(
        2 * float(numpy_of(
            _decaying()(first_epoch_updates))), rel=1e-6)


def test_a_rule_added_in_a_later_fit_scales_the_schedule_it_traced():
    # The first fit() traces its step with the bare schedule; the rule,
    # added in the second, must reach the step that fit() runs.
    x, y = _linear_data(samples=512)
    updates_per_epoch = len(x) // (2 * MICRO_BATCH)
    model = _linear_model(n_gradients=2, measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.SGD(_decaying(), momentum=0.9),
                  loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    history = model.fit(
        x, y, batch_size=MICRO_BATCH, epochs=2, shuffle=False, verbose=0,
        callbacks=[WindowFromNoiseScale(min_n_gradients=4,
                                        max_n_gradients=4,
                                        learning_rate="linear")]).history
    reference = _linear_model(keras.Model)
    reference.compile(optimizer=keras.optimizers.SGD(
        ScaledFrom(_decaying(), 2.0, 2 * updates_per_epoch), momentum=0.9),
        loss="mse")
    reference.fit(x, y, batch_size=2 * MICRO_BATCH, epochs=2, shuffle=False,
                  verbose=0)
    reference.fit(x, y, batch_size=4 * MICRO_BATCH, shuffle=False, verbose=0)
    assert iterations(model) == iterations(reference) == (
        updates_per_epoch * 5 // 2)
    for ours, theirs in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    assert history["window_learning_rate"][0] == pytest.approx(
        2 * float(numpy_of(
            _decaying()(2 * updates_per_epoch))), rel=1e-6)


def test_a_scaled_schedule_is_saved_with_the_model(tmp_path):
    # The factor is saved in the optimizer's config: a loaded model goes on
    # training with it (on JAX and PyTorch the window reads it from its
    # state, which the loaded model's window must take up).
    x, y = _linear_data(samples=512)
    model = _linear_model(n_gradients=2, measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.SGD(_decaying()), loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[WindowFromNoiseScale(
                  min_n_gradients=4, max_n_gradients=4,
                  learning_rate="linear")])
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    rate = loaded.optimizer._learning_rate
    assert type(rate).__name__.endswith("WindowScaledSchedule")
    assert rate.scale_value() == 2.0
    for trained in (model, loaded):
        trained.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False,
                    verbose=0)
    assert iterations(loaded) == iterations(model)
    for ours, theirs in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7)



def test_two_replicas_size_the_window_as_one_device(two_replicas):
    x, y = _linear_data()
    _, one = _fit(WindowFromNoiseScale(), learning_rate=0.0, epochs=1)
    with two_replicas.scope():
        model = _linear_model(n_gradients=2, measure_noise_scale=True)
        # keras 3.15.1 on TensorFlow 2.21 runs no execution of several
        # steps under MirroredStrategy (plain Keras neither).
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        keras.utils.set_random_seed(0)
        two = model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, verbose=0,
                        callbacks=[WindowFromNoiseScale()]).history
    assert two["window_n_gradients"] == one["window_n_gradients"]


class _Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("learning_rate", [
    lambda: 1e-4,
    lambda: keras.optimizers.schedules.ExponentialDecay(1e-4, 2000, 0.5),
], ids=["float", "schedule"])
def test_a_resumed_training_keeps_the_window_and_learning_rate(
        tmp_path, learning_rate):
    # BackupAndRestore saves the callback's state beside the window in the
    # model's file: the resumed epochs size and scale as the uninterrupted
    # training does, rather than taking the restored learning rate for
    # the starting one (a float), or starting the schedule's factor anew.
    x, y = _linear_data(2048)

    def fit(callbacks):
        keras.utils.set_random_seed(0)
        model = _linear_model(n_gradients=2, measure_noise_scale=True)
        model.compile(optimizer=keras.optimizers.SGD(learning_rate()),
                      loss="mse", steps_per_execution=STEPS_PER_EXECUTION)
        return model, model.fit(
            x, y, batch_size=MICRO_BATCH, epochs=4, shuffle=False, verbose=0,
            callbacks=[WindowFromNoiseScale(learning_rate="linear")]
            + callbacks).history

    whole_model, whole = fit([])
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        fit([backup, _Interrupt()])
    model, resumed = fit([keras.callbacks.BackupAndRestore(
        str(tmp_path / "backup"))])
    assert len(resumed["window_n_gradients"]) == 2
    assert resumed["window_n_gradients"] == whole["window_n_gradients"][2:]
    assert whole["window_n_gradients"][1] != 2
    np.testing.assert_allclose(resumed["window_learning_rate"],
                               whole["window_learning_rate"][2:], rtol=1e-5)
    np.testing.assert_allclose(resumed["smoothed_noise_scale"],
                               whole["smoothed_noise_scale"][2:], rtol=1e-3)
    for ours, theirs in zip(model.get_weights(), whole_model.get_weights()):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
