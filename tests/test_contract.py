"""The contract of AccumulatingModel: arguments, counts, state, callbacks."""

import numpy as np
import pytest

from accum_model import AccumulatingModel
from backends import keras_2_too
from backends import keras_3_only
from backends import tensorflow_only
from helpers import keras
from helpers import numpy_of
from helpers import iterations
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data
from helpers import windows_reference

pytestmark = keras_2_too


class Recorder(keras.callbacks.Callback):
    """Records, after every micro-batch, what a user callback can see."""

    def __init__(self):
        super().__init__()
        self.iterations = []
        self.kernels = []
        self.slots = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        self.iterations.append(int(numpy_of(optimizer.iterations)))
        self.kernels.append(numpy_of(self.model.layers[1].kernel).copy())
        self.slots.append([numpy_of(v).copy() for v in optimizer.variables[1:]])


def _compiled(n_gradients=4, optimizer=None, **kwargs):
    model = mlp(AccumulatingModel, n_gradients=n_gradients, **kwargs)
    model.compile(optimizer=optimizer or keras.optimizers.Adam(0.01),
                  loss="mse")
    return model


@pytest.mark.parametrize(
    "value", [0, -1, 2.5, "4", None, True, False, 4.0, [4]]
)
def test_bad_n_gradients_is_refused_at_construction(value):
    inputs = keras.Input((3,))
    outputs = keras.layers.Dense(1)(inputs)
    with pytest.raises(ValueError, match="n_gradients") as error:
        AccumulatingModel(inputs=inputs, outputs=outputs, n_gradients=value)
    assert f"Received: n_gradients={value!r}" in str(error.value)


def test_bad_n_gradients_is_refused_for_subclasses():
    class Net(AccumulatingModel):
        def __init__(self, **kwargs):
            super().__init__(n_gradients=0, **kwargs)

    with pytest.raises(ValueError, match="n_gradients=0"):
        Net()


@pytest.mark.parametrize("value", [None, 1, "yes"])
def test_bad_flush_each_epoch_is_refused(value):
    with pytest.raises(ValueError, match="flush_each_epoch"):
        mlp(AccumulatingModel, n_gradients=2, flush_each_epoch=value)


def test_n_gradients_is_kept():
    assert mlp(AccumulatingModel, n_gradients=3).n_gradients == 3
    assert mlp(AccumulatingModel).n_gradients == 1


_OWN_ACCUMULATION = keras_3_only(
    "an optimizer's gradient_accumulation_steps")


@_OWN_ACCUMULATION
def test_optimizer_that_accumulates_is_refused_before_training():
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(
        optimizer=keras.optimizers.SGD(gradient_accumulation_steps=2),
        loss="mse",
    )
    x, y = regression_data(samples=16)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        model.fit(x, y, batch_size=8, verbose=0)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2"):
        model.train_on_batch(x, y)
    assert int(numpy_of(model.optimizer.iterations)) == 0


@_OWN_ACCUMULATION
def test_optimizer_swapped_after_compile_is_checked_too():
    model = _compiled()
    model.optimizer = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(gradient_accumulation_steps=3)
    )
    weights = model.get_weights()
    x, y = regression_data(samples=16)
    with pytest.raises(ValueError, match="accumulated twice"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert max(np.abs(a - b).max()
               for a, b in zip(weights, model.get_weights())) == 0.0


def test_loss_without_reduction_is_refused():
    model = mlp(AccumulatingModel, n_gradients=2)
    model.compile(
        optimizer="sgd", loss=keras.losses.MeanSquaredError(reduction="none")
    )
    x, y = regression_data(samples=16)
    before = model.get_weights()
    with pytest.raises(ValueError, match="reduction='none'"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert all(np.array_equal(a, b)
               for a, b in zip(before, model.get_weights()))


def test_updates_counted_once_per_window_and_at_epoch_end():
    x, y = regression_data(samples=100)
    model = _compiled()
    recorder = Recorder()
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0,
              callbacks=[recorder])
    # 13 micro-batches an epoch: windows end after micro-batches 4, 8, 12
    # and, at the end of the epoch, 13 (4 samples).
    first_epoch = [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 4]
    assert recorder.iterations == first_epoch + [i + 4 for i in first_epoch]
    assert iterations(model) == 8


def test_weights_and_optimizer_slots_move_only_at_window_ends():
    x, y = regression_data(samples=64)
    model = _compiled()
    initial_kernel = numpy_of(model.layers[1].kernel).copy()
    recorder = Recorder()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0,
              callbacks=[recorder])
    kernels = [initial_kernel] + recorder.kernels
    for step in range(1, 9):
        moved = not np.array_equal(kernels[step], kernels[step - 1])
        assert moved == (step % 4 == 0), step
    for step in (1, 2, 5, 6):
        for before, after in zip(recorder.slots[step - 1],
                                 recorder.slots[step]):
            np.testing.assert_array_equal(before, after)
    assert any(
        not np.array_equal(before, after)
        for before, after in zip(recorder.slots[2], recorder.slots[3])
    )


def test_callbacks_see_every_micro_batch_and_history_has_compiled_metrics():
    x, y = regression_data(samples=100)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    recorder = Recorder()
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                        verbose=0, validation_data=(x[:20], y[:20]),
                        callbacks=[recorder])
    assert len(recorder.iterations) == 26
    assert set(history.history) == {"loss", "mae", "val_loss", "val_mae"}
    assert all(len(v) == 2 for v in history.history.values())


def test_reported_loss_is_the_window_loss_weighted_by_samples():
    # With a learning rate of 0 nothing moves, so the epoch loss must be the
    # loss of the whole data set, exactly as `evaluate` computes it (windows
    # of 32, 32, 32 and 4 samples).
    x, y = regression_data(samples=100)
    model = _compiled(optimizer=keras.optimizers.SGD(0.0))
    history = model.fit(x, y, batch_size=8, epochs=1, shuffle=False,
                        verbose=0)
    expected = model.evaluate(x, y, batch_size=100, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], expected,
                               rtol=1e-5)


@pytest.mark.parametrize("validation", ["validation_data",
                                        "validation_split"])
@pytest.mark.parametrize("flush_each_epoch", [True, False])
def test_logged_loss_under_validation_is_the_training_loss(
        validation, flush_each_epoch):
    # Validation resets the loss tracker the window's loss is read from: the
    # epoch's `loss` must stay the training loss, as plain Keras logs it.
    x, y = regression_data(samples=160)
    fit_kwargs = ({"validation_data": (x[:32], -3 * y[:32])}
                  if validation == "validation_data"
                  else {"validation_split": 0.2})
    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model = _compiled(optimizer=keras.optimizers.SGD(0.05),
                      flush_each_epoch=flush_each_epoch)
    model.set_weights(plain.get_weights())
    expected = plain.fit(x, y, batch_size=32, epochs=3, shuffle=False,
                         verbose=0, **fit_kwargs).history
    logged = model.fit(x, y, batch_size=8, epochs=3, shuffle=False,
                       verbose=0, **fit_kwargs).history
    assert set(logged) == set(expected) == {"loss", "val_loss"}
    for name in expected:
        np.testing.assert_allclose(logged[name], expected[name], rtol=1e-5,
                                   err_msg=name)


def test_callbacks_monitoring_loss_act_as_on_the_large_batch():
    # The validation loss grows while the training loss falls: a callback
    # that took the one for the other would cut the rate and stop early.
    x, y = regression_data(samples=128)
    validation = (x[:32], -3 * y[:32])

    def callbacks():
        return [keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5,
                                                  patience=0),
                keras.callbacks.EarlyStopping(monitor="loss", patience=0)]

    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    model = _compiled(optimizer=keras.optimizers.SGD(0.05))
    model.set_weights(plain.get_weights())
    expected = plain.fit(x, y, batch_size=32, epochs=4, shuffle=False,
                         verbose=0, validation_data=validation,
                         callbacks=callbacks()).history
    logged = model.fit(x, y, batch_size=8, epochs=4, shuffle=False,
                       verbose=0, validation_data=validation,
                       callbacks=callbacks()).history
    assert len(logged["loss"]) == len(expected["loss"]) == 4
    rate = "learning_rate" if "learning_rate" in expected else "lr"  # Keras 2
    np.testing.assert_allclose(logged[rate], expected[rate])
    assert iterations(model) == iterations(plain) == 16
    assert max_weight_difference(plain, model) <= 1e-5


@pytest.mark.parametrize("stop_at", ["epoch_end", "batch"])
def test_a_window_applied_after_validation_joins_the_training_loss(stop_at):
    # Windows run across epochs; training stops, and the open window is
    # applied, only after validation ran: its loss is the training loss's.
    class Stop(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if stop_at == "batch" and batch == 9:
                self.model.stop_training = True

        def on_epoch_end(self, epoch, logs=None):
            self.model.stop_training = True

    x, y = regression_data(samples=100)
    histories = []
    for fit_kwargs in ({}, {"validation_data": (x[:20], -3 * y[:20])}):
        model = _compiled(optimizer=keras.optimizers.SGD(0.05),
                          flush_each_epoch=False)
        histories.append(model.fit(x, y, batch_size=8, epochs=3,
                                   shuffle=False, verbose=0,
                                   callbacks=[Stop()], **fit_kwargs).history)
        assert iterations(model) == (3 if stop_at == "batch" else 4)
    without, with_validation = histories
    np.testing.assert_allclose(with_validation["loss"], without["loss"],
                               rtol=1e-6)


def test_n_gradients_1_is_plain_keras():
    x, y = regression_data(samples=100)
    plain = mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    ours = mlp(AccumulatingModel, n_gradients=1)
    ours.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    ours.set_weights(plain.get_weights())
    plain_history = plain.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                              verbose=0)
    our_history = ours.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                           verbose=0)
    assert max_weight_difference(plain, ours) == 0.0
    assert iterations(ours) == iterations(plain) == 26
    assert our_history.history == plain_history.history


def test_windows_carried_across_epochs_and_applied_when_fit_returns():
    x, y = regression_data(samples=100)
    model = _compiled(optimizer=keras.optimizers.Adam(0.01),
                      flush_each_epoch=False)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    epoch = list(range(100))
    micro = [epoch[i:i + 8] for i in range(0, 100, 8)] * 2  # 26 batches
    windows = [sum(micro[i:i + 4], []) for i in range(0, 26, 4)]
    # The 4th window spans both epochs; the 7th (2 micro-batches) is what
    # was still open when fit() returned.
    assert [len(w) for w in windows] == [32, 32, 32, 28, 32, 32, 12]
    plain = windows_reference(x, y, windows, keras.optimizers.Adam(0.01))
    assert iterations(model) == 7
    assert max_weight_difference(plain, model) <= 1e-5


def test_window_cut_by_stop_training_is_applied():
    class StopAfterFifth(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 4:
                self.model.stop_training = True

    x, y = regression_data(samples=100)
    model = _compiled(optimizer=keras.optimizers.SGD(0.1))
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
              callbacks=[StopAfterFifth()])
    plain = windows_reference(
        x, y, [list(range(32)), list(range(32, 40))],
        keras.optimizers.SGD(0.1),
    )
    assert iterations(model) == 2
    assert max_weight_difference(plain, model) <= 1e-6


def test_accumulators_are_not_weights():
    x, y = regression_data(samples=32)
    plain = mlp(keras.Model)
    model = _compiled()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(model.weights) == len(plain.weights)
    assert len(model.trainable_weights) == len(plain.trainable_weights)
    assert len(model.non_trainable_weights) == 0
    assert model.accumulator_bytes == 4 * sum(
        int(np.prod(w.shape)) for w in model.trainable_weights
    )


def test_evaluate_and_predict_are_those_of_keras():
    x, y = regression_data(samples=40)
    plain = mlp(keras.Model)
    plain.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    plain.set_weights(model.get_weights())
    assert model.evaluate(x, y, verbose=0) == plain.evaluate(x, y, verbose=0)
    np.testing.assert_array_equal(model.predict(x, verbose=0),
                                  plain.predict(x, verbose=0))


def test_gradients_of_frozen_layers_are_not_applied():
    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.layers[1].trainable = False
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    frozen = numpy_of(model.layers[1].kernel).copy()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    np.testing.assert_array_equal(frozen, numpy_of(model.layers[1].kernel))
    assert len(model.trainable_weights) == 2


@tensorflow_only("tf.distribute strategies")
def test_unsupported_strategy_is_refused_before_training():
    import tensorflow as tf

    strategy = tf.distribute.experimental.CentralStorageStrategy(
        ["/cpu:0", "/cpu:1"]
    )
    with strategy.scope():
        model = _compiled()
    x, y = regression_data(samples=16)
    with pytest.raises(ValueError, match="CentralStorageStrategy"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_ci_runs_the_readme_test_command():
    import pathlib

    root = pathlib.Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    command = 'python -m pip install -e ".[test]" && python -m pytest -n 2'
    assert command in readme
    assert command in (root / ".ci" / "run").read_text().splitlines()


def test_train_on_batch_accumulates_and_open_window_can_be_applied():
    x, y = regression_data(samples=24)
    model = _compiled(n_gradients=2, optimizer=keras.optimizers.SGD(0.1))
    for start in (0, 8, 16):
        model.train_on_batch(x[start:start + 8], y[start:start + 8])
    assert iterations(model) == 1
    model.apply_open_window()
    assert iterations(model) == 2
    plain = windows_reference(x, y, [list(range(16)), list(range(16, 24))],
                               keras.optimizers.SGD(0.1))
    assert max_weight_difference(plain, model) <= 1e-6
    model.apply_open_window()  # an empty window applies nothing
    assert iterations(model) == 2


def test_changing_trainable_weights_between_fits():
    x, y = regression_data(samples=64)
    model = _compiled(n_gradients=4, optimizer=keras.optimizers.SGD(0.1))
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    model.layers[1].trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    frozen = numpy_of(model.layers[1].kernel).copy()
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_array_equal(frozen, numpy_of(model.layers[1].kernel))
    assert iterations(model) == 2  # the new optimizer's updates


def test_open_window_is_never_dropped_when_trainable_weights_change():
    x, y = regression_data(samples=16)
    model = _compiled(n_gradients=4, optimizer=keras.optimizers.SGD(0.1))
    model.train_on_batch(x[:8], y[:8])
    model.layers[1].trainable = False
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="1 micro-batch accumulated"):
        model.train_on_batch(x[8:], y[8:])


def test_nothing_to_train_is_said_as_keras_says_it():
    x, y = regression_data(samples=16)
    model = mlp(AccumulatingModel, n_gradients=2)
    model.trainable = False
    model.compile(optimizer="sgd", loss="mse")
    before = model.get_weights()
    with pytest.warns(UserWarning, match="does not have any trainable"):
        model.fit(x, y, batch_size=8, verbose=0)
    for a, b in zip(before, model.get_weights()):
        np.testing.assert_array_equal(a, b)


@keras_3_only("Keras 2 layers in a Keras 3 model (test_keras2.py has the "
              "converse)")
def test_layers_of_another_keras_are_refused_by_name():
    tf_keras = pytest.importorskip("tf_keras")

    class Legacy(AccumulatingModel):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.legacy_dense = tf_keras.layers.Dense(3)
            self.dense = keras.layers.Dense(3)

        def call(self, inputs):
            return self.dense(inputs) + self.legacy_dense(inputs)

    x, y = regression_data(samples=16)
    model = Legacy(n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="legacy_dense.*tf_keras"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_many_models_in_one_process_trace_without_retracing_warnings(caplog):
    x, y = regression_data(samples=24)
    with caplog.at_level("WARNING"):
        for _ in range(7):
            model = _compiled(n_gradients=2)
            model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    assert not [r for r in caplog.records
                if "apply_open_window" in r.getMessage()]


def test_state_after_the_trainable_weights_error_is_the_open_window():
    # The refused step changes nothing: the open window still holds its
    # micro-batch, and applying it uses the variables it was built for.
    x, y = regression_data(samples=16)
    model = _compiled(n_gradients=4, optimizer=keras.optimizers.SGD(0.1))
    model.train_on_batch(x[:8], y[:8])
    model.layers[1].trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    with pytest.raises(ValueError, match="apply_open_window"):
        model.train_on_batch(x[8:], y[8:])
    assert model._accumulation.open_micro_steps() == 1
    model.layers[1].trainable = True
    model.apply_open_window()
    plain = windows_reference(x, y, [list(range(8))],
                               keras.optimizers.SGD(0.1))
    assert max_weight_difference(plain, model) <= 1e-6
    model.layers[1].trainable = False
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.train_on_batch(x[8:], y[8:])  # the window is empty: accepted


def test_activity_penalty_with_a_masked_output_is_warned_about():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5, 3)).astype("float32")
    x[:, 3:] = 0.0
    y = rng.normal(size=(16, 5, 2)).astype("float32")
    inputs = keras.Input((5, 3))
    masked = keras.layers.Masking(0.0)(inputs)
    outputs = keras.layers.Dense(
        2, activity_regularizer=keras.regularizers.L2(0.1))(masked)
    model = AccumulatingModel(inputs=inputs, outputs=outputs, n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(UserWarning, match="activity penalty.*micro_batch_weight"):
        model.fit(x, y, batch_size=8, verbose=0)


@tensorflow_only("JAX's DataParallel runs float8 as one program "
                 "(test_mixed_precision.py)")
@keras_3_only("float8")
def test_float8_under_two_replicas_is_refused(two_replicas):
    x, y = regression_data(samples=16)
    with two_replicas.scope():
        model = mlp(AccumulatingModel, n_gradients=2)
        model.quantize("float8")
        model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="float8.*2 replicas"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_the_constructor_shows_its_arguments():
    # help() and editors read `inspect.signature`.
    import inspect

    parameters = inspect.signature(AccumulatingModel).parameters
    assert [name for name in parameters
            if name in ("n_gradients", "flush_each_epoch",
                        "accumulator_dtype")] == [
        "n_gradients", "flush_each_epoch", "accumulator_dtype"]
    assert parameters["n_gradients"].default == 1


@keras_3_only("Keras 2 layers in a Keras 3 model (test_keras2.py has the "
              "converse)")
@pytest.mark.parametrize("container", ["dict", "nested_list"])
def test_keras_2_layers_in_containers_are_refused_by_name(container):
    tf_keras = pytest.importorskip("tf_keras")

    class Holder(keras.layers.Layer):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            legacy = tf_keras.layers.Dense(3)
            self.parts = ({"legacy": legacy} if container == "dict"
                          else [[keras.layers.Dense(3), legacy]])
            self.dense = keras.layers.Dense(3)

        def call(self, inputs):
            return self.dense(inputs)

    inputs = keras.Input((6,))
    model = AccumulatingModel(inputs=inputs,
                              outputs=Holder(name="holder")(inputs),
                              n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = regression_data(samples=16)
    named = ("holder.parts['legacy']" if container == "dict"
             else "holder.parts[0][1]")
    with pytest.raises(ValueError, match="another Keras") as error:
        model.fit(x, y, batch_size=8, verbose=0)
    assert named in str(error.value)


def test_fit_before_compile_gives_keras_own_error():
    x, y = regression_data(samples=16)
    errors = []
    for model in (mlp(keras.Model), mlp(AccumulatingModel, n_gradients=2)):
        # Keras 3 raises a ValueError, Keras 2 a RuntimeError.
        with pytest.raises((ValueError, RuntimeError), match="compile") as e:
            model.fit(x, y, batch_size=8, verbose=0)
        errors.append(e.value)
    assert type(errors[0]) is type(errors[1])


@pytest.mark.parametrize("keyword", ["steps_per_execution", "jit_compile"])
def test_a_compile_argument_given_to_fit_is_named_as_compiles(keyword):
    x, y = regression_data(samples=16)
    model = _compiled(n_gradients=2)
    with pytest.raises(TypeError, match=f"'{keyword}': it is an argument "
                                        r"of compile\(\)"):
        model.fit(x, y, batch_size=8, verbose=0, **{keyword: 2})
    with pytest.raises(TypeError, match="fit\\(\\) got arguments it does "
                                        "not take.*unknown_argument"):
        model.fit(x, y, batch_size=8, verbose=0, unknown_argument=2)
    assert iterations(model) == 0


def test_a_setting_given_to_fit_is_named_as_the_models():
    x, y = regression_data(samples=16)
    model = _compiled(n_gradients=2)
    with pytest.raises(TypeError, match="'n_gradients': it is a setting of "
                                        "the model.*accumulating"):
        model.fit(x, y, batch_size=8, verbose=0, n_gradients=4)
    assert iterations(model) == 0


def test_accumulating_names_a_misspelt_or_missing_argument():
    from accum_model import accumulating
    model = mlp(keras.Model)
    with pytest.raises(TypeError, match="'n_gradient'. Did you mean "
                                        "`n_gradients`"):
        accumulating(model, n_gradient=4)
    with pytest.raises(TypeError, match="needs `n_gradients`"):
        accumulating(model)
    assert not isinstance(model, AccumulatingModel)


def test_a_layer_given_as_a_model_is_told_to_wrap_it():
    from accum_model import accumulating
    with pytest.raises(ValueError, match="given a layer.*Sequential") as e:
        accumulating(keras.layers.Dense(2), 4)
    assert "TF_USE_LEGACY_KERAS" not in str(e.value)

