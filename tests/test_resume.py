"""Resume: a checkpoint taken between two updates carries the open window.

Each test trains once without interruption, and once more from a checkpoint
taken after micro-batch `SAVED_AFTER` (in the middle of a window), feeding
the micro-batches that follow it. Both runs must end equal. Checkpoints
and backups run under Keras 2 too.
"""

import warnings

import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model import accumulating
from backends import ON_TENSORFLOW
from backends import ON_KERAS_2
from backends import keras_2_too
from backends import keras_3_only
from backends import not_on_jax
from backends import tensorflow_only
from helpers import AfterMicroBatch
from helpers import iterations, keras, max_weight_difference, mlp
from helpers import regression_data
from helpers import weights_file

if ON_TENSORFLOW:
    import tensorflow as tf

MICRO_BATCH = 8
N_GRADIENTS = 4
MICRO_BATCHES = 10  # windows of 4, 4, then 2 flushed at the epoch's end
SAVED_AFTER = 6  # two micro-batches into the second window

pytestmark = keras_2_too


def make_optimizer(name):
    if name == "adam":
        return keras.optimizers.Adam(0.05)
    if name == "sgd":
        return keras.optimizers.SGD(0.1)
    return keras.optimizers.SGD(0.1, momentum=0.9)


def compiled(optimizer, model_class=AccumulatingModel, **kwargs):
    model = mlp(model_class, n_gradients=N_GRADIENTS, **kwargs)
    model.compile(optimizer=make_optimizer(optimizer), loss="mse")
    return model


def _data():
    return regression_data(samples=MICRO_BATCH * MICRO_BATCHES)


def _uninterrupted(optimizer, **kwargs):
    x, y = _data()
    model = compiled(optimizer, **kwargs)
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False, verbose=0)
    return model


def _rest_of_the_epoch(model):
    x, y = _data()
    rest = slice(SAVED_AFTER * MICRO_BATCH, None)
    model.fit(x[rest], y[rest], batch_size=MICRO_BATCH, epochs=1,
              shuffle=False, verbose=0)
    return model


def _first_run_saving(optimizer, callback, **kwargs):
    """The interrupted run: trains the epoch with `callback` saving in it."""
    x, y = _data()
    model = compiled(optimizer, **kwargs)
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False,
              verbose=0, callbacks=[callback])
    return model


def _save_and_load(how, path, optimizer, **kwargs):
    """(callback saving after SAVED_AFTER micro-batches, fn loading it into
    a model compiled with `optimizer` and `kwargs`)."""
    if how == "keras_file":
        file = str(path / "mid.keras")
        save = AfterMicroBatch(SAVED_AFTER, lambda m: m.save(file))
        return save, lambda: keras.models.load_model(file)
    if how in ("weights_file", "model_checkpoint_weights"):
        file = weights_file(path, "mid")
        if how == "weights_file":
            save = AfterMicroBatch(SAVED_AFTER, lambda m: m.save_weights(file))
        else:
            save = keras.callbacks.ModelCheckpoint(
                file, save_weights_only=True, save_freq=SAVED_AFTER
            )

        def load():
            model = compiled(optimizer, **kwargs)
            # Keras loads optimizer variables only into a built optimizer.
            model.optimizer.build(model.trainable_variables)
            model.load_weights(file)
            return model

        return save, load
    if how == "model_checkpoint_model":
        file = str(path / "mid.keras")
        save = keras.callbacks.ModelCheckpoint(file, save_freq=SAVED_AFTER)
        return save, lambda: keras.models.load_model(file)
    if how == "tf_checkpoint":
        directory = str(path / "tf")

        def save_checkpoint(model):
            checkpoint = tf.train.Checkpoint(model=model,
                                             optimizer=model.optimizer)
            tf.train.CheckpointManager(checkpoint, directory, 2).save()

        def load():
            model = compiled(optimizer, **kwargs)
            checkpoint = tf.train.Checkpoint(model=model,
                                             optimizer=model.optimizer)
            checkpoint.restore(tf.train.latest_checkpoint(directory))
            return model

        return AfterMicroBatch(SAVED_AFTER, save_checkpoint), load
    raise ValueError(how)


# Keras 2's `.keras` files cannot hold the window (it warns when saving).
_KERAS_3_FILES = keras_3_only("a .keras file holding the window")
SAVES = [pytest.param("keras_file", marks=_KERAS_3_FILES), "weights_file",
         "model_checkpoint_weights",
         pytest.param("model_checkpoint_model", marks=_KERAS_3_FILES),
         pytest.param("tf_checkpoint",
                      marks=tensorflow_only("tf.train.Checkpoint"))]


@pytest.mark.parametrize("optimizer", ["adam", "sgd_momentum"])
@pytest.mark.parametrize("how", SAVES)
def test_resume_from_the_middle_of_a_window_is_exact(how, optimizer, tmp_path):
    reference = _uninterrupted(optimizer)
    save, load = _save_and_load(how, tmp_path, optimizer)
    _first_run_saving(optimizer, save)

    resumed = load()
    assert resumed._accumulation.open_micro_steps() == SAVED_AFTER % N_GRADIENTS
    _rest_of_the_epoch(resumed)

    assert iterations(resumed) == iterations(reference) == 3
    assert max_weight_difference(resumed, reference) <= 2e-5


def test_resumed_windows_equal_plain_keras_large_batches(tmp_path):
    # The windows of the interrupted epoch are 4, 4 and 2 micro-batches.
    x, y = _data()
    save, load = _save_and_load("weights_file", tmp_path, "adam")
    _first_run_saving("adam", save)
    resumed = _rest_of_the_epoch(load())

    plain = mlp(keras.Model)
    plain.compile(optimizer=make_optimizer("adam"), loss="mse")
    for start, stop in [(0, 4), (4, 8), (8, 10)]:
        rows = slice(start * MICRO_BATCH, stop * MICRO_BATCH)
        plain.train_on_batch(x[rows], y[rows])
    assert max_weight_difference(resumed, plain) <= 2e-5


def test_window_restored_before_it_is_built_waits_for_it(tmp_path):
    # Build, compile, load_weights: the window is built in the first training
    # step, so the restored one waits. (Keras skips the variables of the
    # optimizer, not yet built, with a warning: plain SGD keeps none.)
    file = weights_file(tmp_path, "mid")
    _first_run_saving(
        "sgd", AfterMicroBatch(SAVED_AFTER, lambda m: m.save_weights(file))
    )
    resumed = mlp(AccumulatingModel, n_gradients=N_GRADIENTS)
    resumed.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    resumed.load_weights(file)
    assert resumed._accumulation.window is None
    assert resumed._accumulation.open_micro_steps() == SAVED_AFTER % N_GRADIENTS
    _rest_of_the_epoch(resumed)

    reference = mlp(AccumulatingModel, n_gradients=N_GRADIENTS)
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = _data()
    reference.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    # Plain SGD keeps no state: only the window decides the weights.
    assert max_weight_difference(resumed, reference) <= 2e-5


def test_weights_saved_mid_window_load_into_a_plain_model(tmp_path):
    file = weights_file(tmp_path, "mid")
    trained = _first_run_saving(
        "adam", AfterMicroBatch(SAVED_AFTER, lambda m: m.save_weights(file))
    )
    trained.save_weights(file)  # after the epoch: window flushed, still kept
    plain = mlp(keras.Model)
    plain.compile(optimizer=make_optimizer("adam"), loss="mse")
    plain.optimizer.build(plain.trainable_variables)
    plain.load_weights(file)
    assert max_weight_difference(plain, trained) == 0.0


def test_file_without_a_window_empties_the_open_window(tmp_path):
    file = weights_file(tmp_path, "plain")
    plain = mlp(keras.Model)
    plain.save_weights(file)
    model = compiled("sgd")
    x, y = _data()
    model.train_on_batch(x[:MICRO_BATCH], y[:MICRO_BATCH])
    assert model._accumulation.open_micro_steps() == 1
    model.load_weights(file)
    assert model._accumulation.open_micro_steps() == 0
    assert max_weight_difference(model, plain) == 0.0


def test_window_of_other_weights_is_refused_by_name(tmp_path):
    file = weights_file(tmp_path, "mid")
    _first_run_saving(
        "sgd", AfterMicroBatch(SAVED_AFTER, lambda m: m.save_weights(file))
    )
    # Frozen before compiling: Keras 2 reads `trainable` as it compiles.
    model = mlp(AccumulatingModel, n_gradients=N_GRADIENTS)
    model.layers[-1].trainable = False
    model.compile(optimizer=make_optimizer("sgd"), loss="mse")
    x, y = _data()
    model.load_weights(file)
    with pytest.raises(ValueError, match="same trainable weights"):
        model.fit(x, y, batch_size=MICRO_BATCH, verbose=0)


class _StopAfterEpoch(keras.callbacks.Callback):
    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt("preempted")


def test_window_carried_over_an_epoch_survives_backup_and_restore(tmp_path):
    x, y = _data()
    epochs = 3

    def fresh():
        model = compiled("adam", flush_each_epoch=False)
        return model

    reference = fresh()
    reference.fit(x, y, batch_size=MICRO_BATCH, epochs=epochs, shuffle=False,
                  verbose=0)

    backup = str(tmp_path / "backup")
    interrupted = fresh()
    with pytest.raises(KeyboardInterrupt):
        interrupted.fit(
            x, y, batch_size=MICRO_BATCH, epochs=epochs, shuffle=False,
            verbose=0,
            callbacks=[keras.callbacks.BackupAndRestore(backup),
                       _StopAfterEpoch(0)],
        )
    # 10 micro-batches per epoch, windows of 4: 2 are carried over.
    assert interrupted._accumulation.open_micro_steps() == 2

    resumed = fresh()
    resumed.fit(x, y, batch_size=MICRO_BATCH, epochs=epochs, shuffle=False,
                verbose=0, callbacks=[keras.callbacks.BackupAndRestore(backup)])
    assert iterations(resumed) == iterations(reference) == 30 // 4 + 1
    assert max_weight_difference(resumed, reference) <= 2e-5


def test_resume_under_two_replicas_is_exact(two_replicas, tmp_path):
    def compiled_under_strategy():
        with two_replicas.scope():
            return compiled("adam")

    x, y = _data()
    batch = 2 * MICRO_BATCH  # each replica gets MICRO_BATCH samples
    reference = compiled_under_strategy()
    with two_replicas.scope():
        reference.fit(x, y, batch_size=batch, shuffle=False, verbose=0)

    saved_after = 3
    file = weights_file(tmp_path, "mid")
    directory = str(tmp_path / "tf")

    def save(model):
        model.save_weights(file)
        if ON_TENSORFLOW:
            checkpoint = tf.train.Checkpoint(model=model,
                                             optimizer=model.optimizer)
            tf.train.CheckpointManager(checkpoint, directory, 1).save()

    interrupted = compiled_under_strategy()
    with two_replicas.scope():
        interrupted.fit(x, y, batch_size=batch, shuffle=False, verbose=0,
                        callbacks=[AfterMicroBatch(saved_after, save)])

    rest = slice(saved_after * batch, None)
    loads = ("weights_file", "tf_checkpoint") if ON_TENSORFLOW else (
        "weights_file",)
    for load in loads:
        resumed = compiled_under_strategy()
        if load == "weights_file":
            with two_replicas.scope():
                resumed.optimizer.build(resumed.trainable_variables)
            resumed.load_weights(file)
        else:
            checkpoint = tf.train.Checkpoint(model=resumed,
                                             optimizer=resumed.optimizer)
            checkpoint.restore(tf.train.latest_checkpoint(directory))
        with two_replicas.scope():
            resumed.fit(x[rest], y[rest], batch_size=batch, shuffle=False,
                        verbose=0)
        assert iterations(resumed) == iterations(reference) == 2, load
        assert max_weight_difference(resumed, reference) <= 2e-5, load


@keras_3_only("Keras 2's LossScaleOptimizer counts a skipped step "
              "(tests/test_keras2.py)")
def test_mixed_precision_resumes_the_loss_scale_and_an_overflowed_window(
        tmp_path):
    # Micro-batches 1 and 5 overflow float16: the first window is skipped
    # before the save, the second (open at the save) must be skipped after
    # the resume, from the restored accumulators.
    keras.mixed_precision.set_global_policy("mixed_float16")
    x, y = _data()
    y[1 * MICRO_BATCH + 3] = 1e4
    y[5 * MICRO_BATCH + 2] = 1e4

    def fresh():
        return compiled("adam")

    reference = fresh()
    reference.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)

    file = weights_file(tmp_path, "mid")
    interrupted = fresh()
    interrupted.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0,
                    callbacks=[AfterMicroBatch(SAVED_AFTER,
                                                lambda m: m.save_weights(file))])
    resumed = fresh()
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(file)
    assert resumed.skipped_windows == 1
    rest = slice(SAVED_AFTER * MICRO_BATCH, None)
    resumed.fit(x[rest], y[rest], batch_size=MICRO_BATCH, shuffle=False,
                verbose=0)

    assert reference.skipped_windows == resumed.skipped_windows == 2
    assert iterations(resumed) == iterations(reference) == 1
    assert float(resumed.optimizer.dynamic_scale.numpy()) == float(
        reference.optimizer.dynamic_scale.numpy()
    )
    assert max_weight_difference(resumed, reference) <= 2e-5


@tensorflow_only("tf.saved_model")
@keras_3_only("Model.export")
def test_model_with_a_window_open_exports_for_serving(tmp_path):
    # Export traces the saved state in a graph; it must leave the window
    # out and still serve the model's predictions.
    x, y = _data()
    model = compiled("adam")
    model.train_on_batch(x[:MICRO_BATCH], y[:MICRO_BATCH])
    assert model._accumulation.open_micro_steps() == 1
    model.export(str(tmp_path / "exported"), verbose=False)
    exported = tf.saved_model.load(str(tmp_path / "exported"))
    served = exported.serve(x[:4])
    np.testing.assert_allclose(served.numpy(), model.predict(x[:4], verbose=0),
                               atol=1e-6)


@pytest.mark.parametrize("dtype", [
    "bfloat16", pytest.param("float64", marks=not_on_jax(
        "float64 on JAX needs jax_enable_x64"))])
@pytest.mark.parametrize("how", [
    "weights_file",
    pytest.param("tf_checkpoint", marks=tensorflow_only("tf.train.Checkpoint"))])
def test_resume_keeps_a_window_of_another_accumulator_dtype(dtype, how,
                                                            tmp_path):
    reference = _uninterrupted("adam", accumulator_dtype=dtype)
    save, load = _save_and_load(how, tmp_path, "adam",
                                accumulator_dtype=dtype)
    _first_run_saving("adam", save, accumulator_dtype=dtype)
    # Restored before the window is built: it waits for it.
    resumed = load()
    _rest_of_the_epoch(resumed)
    parameters = sum(int(np.prod(w.shape)) for w in resumed.trainable_weights)
    bytes_per_element = {"bfloat16": 2, "float64": 8}[dtype]
    assert resumed.accumulator_bytes == parameters * bytes_per_element
    assert iterations(resumed) == iterations(reference) == 3
    assert max_weight_difference(resumed, reference) <= 2e-5


@pytest.mark.skipif(not ON_KERAS_2, reason="Keras 2's load_weights of a "
                    "TensorFlow-format file (Keras 3's files hold any dtype)")
@pytest.mark.parametrize("saved, loaded", [("float64", "float32"),
                                           ("float32", "float64")])
def test_weights_of_a_window_saved_in_another_dtype_are_refused_by_name(
        saved, loaded, tmp_path):
    save, _ = _save_and_load("weights_file", tmp_path, "sgd",
                             accumulator_dtype=saved)
    _first_run_saving("sgd", save, accumulator_dtype=saved)
    model = compiled("sgd", accumulator_dtype=loaded)
    model.optimizer.build(model.trainable_variables)
    with pytest.raises(ValueError, match=f"window is saved as {saved},"
                       ".*accumulator_dtype") as refusal:
        model.load_weights(weights_file(tmp_path, "mid"))
    assert ("accumulator_dtype='float64'" in str(refusal.value)) == (
        saved == "float64")


def test_window_loaded_into_another_n_gradients_ends_then_takes_the_new(
        tmp_path):
    # Saved with 2 of 4 micro-batches open; loaded into a model with
    # n_gradients=2: the open window still ends at 4, then windows of 2.
    file = weights_file(tmp_path, "mid")
    _first_run_saving("sgd", AfterMicroBatch(
        SAVED_AFTER, lambda m: m.save_weights(file)))
    model = mlp(AccumulatingModel, n_gradients=2)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.load_weights(file)
    x, y = _data()
    updates = []
    for step in range(6):
        rows = slice(step * MICRO_BATCH, (step + 1) * MICRO_BATCH)
        model.train_on_batch(x[rows], y[rows])
        updates.append(iterations(model))
    # The saved optimizer had applied 1 update.
    assert updates == [1, 2, 2, 3, 3, 4]


def _accumulating_sequential():
    keras.utils.set_random_seed(1)
    model = accumulating(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3)]), n_gradients=N_GRADIENTS)
    model.compile(optimizer=make_optimizer("adam"), loss="mse")
    return model


@_KERAS_3_FILES
def test_a_sequential_saved_mid_window_says_how_to_get_its_window_back(
        tmp_path):
    # A Sequential made accumulating saves as a Sequential, and
    # `load_model` gives back a plain one that leaves the window in the
    # file: the save names the way back, which resumes exactly.
    x, y = _data()
    reference = _accumulating_sequential()
    reference.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    file = str(tmp_path / "mid.keras")
    interrupted = _accumulating_sequential()
    with pytest.warns(UserWarning, match="load_weights") as caught:
        interrupted.fit(x, y, batch_size=MICRO_BATCH, shuffle=False,
                        verbose=0, callbacks=[AfterMicroBatch(
                            SAVED_AFTER, lambda m: m.save(file))])
    named = [str(w.message) for w in caught
             if "load_weights" in str(w.message)]
    assert len(named) == 1 and "(2 micro-batches" in named[0]

    resumed = accumulating(keras.models.load_model(file),
                           n_gradients=N_GRADIENTS)
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(file)
    assert resumed._accumulation.open_micro_steps() == 2
    _rest_of_the_epoch(resumed)
    assert iterations(resumed) == iterations(reference) == 3
    assert max_weight_difference(resumed, reference) <= 2e-5


@_KERAS_3_FILES
def test_a_functional_model_saved_mid_window_is_quiet(tmp_path):
    file = str(tmp_path / "mid.keras")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _first_run_saving("adam", AfterMicroBatch(
            SAVED_AFTER, lambda m: m.save(file)))


class _StopAfterBatch(keras.callbacks.Callback):
    def __init__(self, batch):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            raise KeyboardInterrupt("preempted")


def _backed_up_and_resumed(make_model, batch_size, save_freq, stop_after,
                           directory):
    """Two epochs, preempted in the first after batch `stop_after`, then
    resumed from `BackupAndRestore(save_freq=save_freq)`."""
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(KeyboardInterrupt):
            make_model().fit(
                x, y, batch_size=batch_size, epochs=2, shuffle=False,
                verbose=0, callbacks=[
                    keras.callbacks.BackupAndRestore(directory,
                                                     save_freq=save_freq),
                    _StopAfterBatch(stop_after)])
    resumed = make_model()
    resumed.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False,
                verbose=0, callbacks=[keras.callbacks.BackupAndRestore(
                    directory, save_freq=save_freq)])
    named = [str(w.message) for w in caught
             if "BackupAndRestore" in str(w.message)]
    return resumed, named


@keras_3_only("Keras 2's BackupAndRestore resumes mid-epoch")
@pytest.mark.parametrize("save_freq", [4, 6])
def test_backups_inside_a_window_are_named(save_freq, tmp_path):
    # Keras replays the epoch of a mid-epoch backup from its first batch.
    # A backup at a window's end replays as plain Keras's large batch does
    # under the same preemption (after its second batch of 32); one inside
    # a window cannot, and fit() says so before training.
    def plain_model():
        model = mlp(keras.Model)
        model.compile(optimizer=make_optimizer("adam"), loss="mse")
        return model

    plain, _ = _backed_up_and_resumed(plain_model, 32, 1, 1,
                                      str(tmp_path / "plain"))
    resumed, named = _backed_up_and_resumed(
        lambda: compiled("adam"), MICRO_BATCH, save_freq, 7,
        str(tmp_path / "window"))
    exact = max_weight_difference(plain, resumed) <= 2e-5
    assert exact == (save_freq == 4)
    assert len(named) == (0 if exact else 1)
    if named:
        assert "save_freq=6" in named[0] and "'epoch'" in named[0]
