"""`micro_batch_size`: the batch of `fit()` split inside the step is the
large batch.

Plain Keras trains on batches of B; the accumulating model gets the same
batches of B and splits each into micro-batches of at most b inside its
step. Weights, logged losses and update counts must match, with every count
in the batches of `fit()`.
"""

import contextlib

import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model import accumulating
from backends import ON_JAX
from backends import ON_KERAS_2
from backends import ON_TENSORFLOW
from backends import ON_TORCH
from backends import jax_only
from backends import keras_2_too
from helpers import compiled_jax_step
from helpers import counted_steps
from helpers import iterations
from helpers import keras
from helpers import loss_scale
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data
from helpers import skip_unless_executions_stop_cleanly

pytestmark = keras_2_too

TOLERANCE = 1e-5

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "rmsprop_clipnorm": lambda: keras.optimizers.RMSprop(0.01, clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(
        0.01, global_clipnorm=0.05),
    "adam_schedule_every_step": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(
            0.02, decay_steps=1, decay_rate=0.7)),
}


def fit_split(build, make_optimizer, x, y, batch_size, micro_batch_size,
              n_gradients=1, epochs=2, strategy=None, fit_kwargs=None,
              loss="mse", compile_kwargs=None):
    """Plain Keras on batches of `batch_size * n_gradients`; the
    accumulating model on batches of `batch_size` split into micro-batches
    of `micro_batch_size`. Returns (plain, model, plain's history, the
    model's history)."""
    fit_kwargs = fit_kwargs or {}
    compile_kwargs = compile_kwargs or {}
    plain = build(keras.Model)
    plain.compile(optimizer=make_optimizer(), loss=loss,
                  **{**compile_kwargs, "run_eagerly": False,
                     "steps_per_execution": 1})
    plain_history = plain.fit(x, y, batch_size=batch_size * n_gradients,
                              epochs=epochs, shuffle=False, verbose=0,
                              **fit_kwargs)
    with (strategy.scope() if strategy is not None
          else contextlib.nullcontext()):
        model = build(AccumulatingModel, n_gradients=n_gradients,
                      micro_batch_size=micro_batch_size)
        model.compile(optimizer=make_optimizer(), loss=loss,
                      **compile_kwargs)
        model.set_weights(build(keras.Model).get_weights())
        history = model.fit(x, y, batch_size=batch_size, epochs=epochs,
                            shuffle=False, verbose=0, **fit_kwargs)
    return plain, model, plain_history, history


def _assert_same_losses(plain_history, history):
    np.testing.assert_allclose(history.history["loss"],
                               plain_history.history["loss"], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_split_batches_match_the_large_batch(name):
    # 100 samples in batches of 32: the last batch holds 4, one short
    # micro-batch.
    x, y = regression_data(samples=100)
    plain, model, plain_history, history = fit_split(
        mlp, OPTIMIZERS[name], x, y, batch_size=32, micro_batch_size=8)
    assert iterations(model) == iterations(plain) == 8
    assert max_weight_difference(plain, model) <= TOLERANCE
    _assert_same_losses(plain_history, history)


@pytest.mark.parametrize("micro_batch_size", [1, 5, 32, 64])
def test_any_micro_batch_size_with_sample_weights(micro_batch_size):
    # 5 leaves a short last micro-batch in every batch (32 = 6 * 5 + 2);
    # 32 and 64 keep each batch whole.
    x, y = regression_data(samples=90)
    weights = np.random.default_rng(3).uniform(size=(90,)).astype("float32")
    plain, model, plain_history, history = fit_split(
        mlp, OPTIMIZERS["adam"], x, y, batch_size=32,
        micro_batch_size=micro_batch_size,
        fit_kwargs={"sample_weight": weights})
    assert iterations(model) == iterations(plain) == 6
    assert max_weight_difference(plain, model) <= TOLERANCE
    _assert_same_losses(plain_history, history)


@pytest.mark.parametrize("run", ["run_eagerly", "steps_per_execution"])
def test_split_batches_run_eagerly_or_several_per_execution(run):
    if run == "steps_per_execution":
        skip_unless_executions_stop_cleanly()
    compile_kwargs = ({"run_eagerly": True} if run == "run_eagerly"
                      else {"steps_per_execution": 2})
    x, y = regression_data(samples=100)
    plain, model, plain_history, history = fit_split(
        mlp, OPTIMIZERS["adam"], x, y, batch_size=32, micro_batch_size=6,
        compile_kwargs={**compile_kwargs, "metrics": ["mae"]})
    assert iterations(model) == iterations(plain) == 8
    assert max_weight_difference(plain, model) <= TOLERANCE
    _assert_same_losses(plain_history, history)
    np.testing.assert_allclose(history.history["mae"],
                               plain_history.history["mae"], rtol=1e-5)


def test_split_batches_compose_with_n_gradients():
    # Windows of 2 batches of 16, each split into 6 + 6 + 4: the large
    # batch of 32.
    x, y = regression_data(samples=96)
    plain, model, plain_history, history = fit_split(
        mlp, OPTIMIZERS["adam"], x, y, batch_size=16, micro_batch_size=6,
        n_gradients=2)
    assert iterations(model) == iterations(plain) == 6
    assert max_weight_difference(plain, model) <= TOLERANCE
    _assert_same_losses(plain_history, history)


def test_callbacks_count_the_batches_of_fit():
    counted = []
    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, micro_batch_size=4)
    model.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[
        keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs: counted.append(
                (batch, model.update_applied)))])
    assert counted == [(0, True), (1, True), (2, True), (3, True)]
    assert iterations(model) == 4


def _padded_sequences(samples=64, max_length=10, vocabulary=12, seed=4):
    from test_exactness import _padded_sequences as sequences

    return sequences(samples, max_length, vocabulary, seed)


def test_masked_sequences_with_uneven_valid_counts():
    from test_exactness import _masked_lstm

    def masked_lstm(model_class, **settings):
        if model_class is keras.Model:
            return _masked_lstm(keras.Model)
        return accumulating(_masked_lstm(keras.Model), **settings)

    x, y = _padded_sequences(samples=72)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain, model, plain_history, history = fit_split(
        masked_lstm, OPTIMIZERS["sgd"], x, y, batch_size=32,
        micro_batch_size=6, loss=loss)
    assert iterations(model) == iterations(plain) == 6
    assert max_weight_difference(plain, model) <= TOLERANCE
    _assert_same_losses(plain_history, history)


def _mixed_float16_and_its_rounding(make_optimizer, x, y, batch_size,
                                    micro_batch_size, n_gradients=1,
                                    epochs=1):
    """`fit_split` under `mixed_float16`, and how far plain Keras's large
    batch lands from its float32 self (float16's rounding, as in
    test_mixed_precision.py)."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        plain, model, _, history = fit_split(
            mlp, make_optimizer, x, y, batch_size=batch_size,
            micro_batch_size=micro_batch_size, n_gradients=n_gradients,
            epochs=epochs)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    in_float32 = mlp(keras.Model)
    in_float32.compile(optimizer=make_optimizer(), loss="mse")
    # Where the large batch skips, float32's large batch skips nothing:
    # its rounding is sized on the batches that were applied.
    skipped = history.history.get("skipped_windows", [0])[-1]
    samples = len(x) if not skipped else batch_size * n_gradients
    in_float32.fit(x[:samples], y[:samples],
                   batch_size=batch_size * n_gradients, epochs=epochs,
                   shuffle=False, verbose=0)
    return plain, model, history, max_weight_difference(plain, in_float32)


def test_mixed_float16_skips_the_batch_the_large_batch_skips():
    # The second batch of 32 holds a target whose error, times the loss
    # scale, overflows float16 in the backward pass.
    from test_mixed_precision import _data_with_overflow_in_second_window

    x, y = _data_with_overflow_in_second_window()
    plain, model, history, rounding = _mixed_float16_and_its_rounding(
        OPTIMIZERS["adam"], x, y, batch_size=32, micro_batch_size=8)
    assert model.skipped_windows == 1
    assert history.history["skipped_windows"] == [1]
    assert iterations(model) == iterations(plain) == counted_steps(2, 1)
    assert loss_scale(model.optimizer) == loss_scale(plain.optimizer)
    assert max_weight_difference(model, plain) <= 2 * rounding + 1e-6


def test_split_batches_under_two_replicas_are_one_devices(two_replicas):
    # Each replica splits its 16 rows into 5 + 5 + 5 + 1.
    x, y = regression_data(samples=96)
    plain, model, plain_history, history = fit_split(
        mlp, OPTIMIZERS["adam_global_clipnorm"], x, y, batch_size=32,
        micro_batch_size=5, strategy=two_replicas)
    assert iterations(model) == iterations(plain) == 6
    assert max_weight_difference(plain, model) <= TOLERANCE
    _assert_same_losses(plain_history, history)


@pytest.mark.skipif(ON_KERAS_2, reason="Keras 2's BatchNormalization "
                    "moves its own statistics")
@pytest.mark.filterwarnings("ignore:BatchNormalization layers")
def test_batch_normalization_moves_by_the_large_batchs_moments():
    # At learning rate 0 every micro-batch sees the large batch's weights:
    # the moving statistics must be the large batch's.
    from test_batch_normalization import conv_bn
    from test_batch_normalization import image_data
    from test_batch_normalization import statistics

    x, y = image_data(100)
    plain, model, _, _ = fit_split(
        conv_bn, lambda: keras.optimizers.SGD(0.0), x, y, batch_size=32,
        micro_batch_size=6)
    assert iterations(model) == iterations(plain) == 8
    for large, split in zip(statistics(plain), statistics(model)):
        np.testing.assert_allclose(split, large, atol=TOLERANCE)


@jax_only("keras.distribution.DataParallel")
def test_data_parallel_reduces_the_gradient_once_per_step(two_replicas):
    import re

    x, y = regression_data(samples=64)
    with two_replicas.scope():
        model = mlp(AccumulatingModel, micro_batch_size=2)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    text = compiled_jax_step(model, two_replicas, x, y, batch_size=16)
    weights = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    # Each all-reduce's elements: the gradient's must be reduced once, by
    # the window end, outside the loop over the micro-batches.
    reduced = [
        sum(int(np.prod([int(d) for d in dims.split(",") if d]))
            for dims in re.findall(r"\w+\[([\d,]*)\]", found.group(1)))
        for found in re.finditer(r"=\s*(.*?)\sall-reduce(?:-start)?\(",
                                 text)]
    assert sum(size for size in reduced if size >= weights // 2) == weights


def test_settings_round_trip_and_refuse_bad_values():
    model = mlp(AccumulatingModel, micro_batch_size=4)
    assert model.micro_batch_size == 4
    assert model.get_config()["micro_batch_size"] == 4
    for bad in (0, -2, 2.5, "8", True):
        with pytest.raises(ValueError, match="micro_batch_size"):
            mlp(AccumulatingModel, micro_batch_size=bad)
    model.micro_batch_size = None
    assert model.micro_batch_size is None


@pytest.mark.skipif(ON_KERAS_2, reason="the .keras format is Keras 3's")
def test_a_functional_model_reloads_with_its_micro_batch_size(tmp_path):
    model = mlp(AccumulatingModel, micro_batch_size=4)
    model.compile(optimizer="sgd", loss="mse")
    path = str(tmp_path / "model.keras")
    model.save(path)
    assert keras.models.load_model(path).micro_batch_size == 4


def test_accumulating_takes_micro_batch_size_alone():
    x, y = regression_data(samples=64)
    plain = mlp(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    model = accumulating(mlp(keras.Model), micro_batch_size=8)
    model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    assert model.n_gradients == 1
    for each in (plain, model):
        each.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert iterations(model) == iterations(plain) == 2
    assert max_weight_difference(plain, model) <= TOLERANCE


def test_a_step_of_ones_own_that_feeds_the_window_is_refused():
    class OwnStep(AccumulatingModel):
        def train_step(self, data):
            x, y = data
            self.accumulate_gradients([], 1.0)
            return {}

    inputs = keras.Input((6,))
    model = OwnStep(inputs, keras.layers.Dense(3)(inputs),
                    micro_batch_size=4)
    model.compile(optimizer="sgd", loss="mse")
    x, y = regression_data(samples=16)
    with pytest.raises(ValueError, match="micro_batch_size=4"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert iterations(model) == 0


@pytest.mark.skipif(not ON_JAX, reason="the compiled step's memory is "
                    "JAX's account")
def test_the_compiled_step_holds_one_micro_batchs_activations():
    from helpers import harness

    x, y = regression_data(samples=512, features=6)

    def wide(model_class, **kwargs):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((6,))
        hidden = inputs
        for _ in range(3):
            hidden = keras.layers.Dense(256, activation="relu")(hidden)
        return model_class(inputs, keras.layers.Dense(3)(hidden), **kwargs)

    temporaries = {}
    for label, model, batch in (
            ("large", wide(keras.Model), 512),
            ("split", wide(AccumulatingModel, micro_batch_size=32), 512),
            ("micro", wide(keras.Model), 32)):
        model.compile(optimizer="sgd", loss="mse")
        temporaries[label] = harness.jax_step_memory(
            model, x[:batch], y[:batch]).temp_size_in_bytes
    # One micro-batch's activations at a time, not the batch's.
    assert temporaries["split"] < 2 * temporaries["micro"] + 2**20
    assert temporaries["split"] < temporaries["large"] / 4


# micro_batch_size="auto" --------------------------------------------------


class _OutOfMemoryAbove(keras.layers.Layer):
    """Raises the backend's out-of-memory error on a batch of more than
    `rows` samples, where a trial runs (eagerly, on real arrays)."""

    def __init__(self, rows, **kwargs):
        super().__init__(**kwargs)
        self.rows = rows

    def call(self, inputs):
        if ON_TORCH:
            import torch

            if inputs.device.type != "meta" and inputs.shape[0] > self.rows:
                raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        else:
            import tensorflow as tf

            if (tf.executing_eagerly() and inputs.shape[0] is not None
                    and inputs.shape[0] > self.rows):
                raise tf.errors.ResourceExhaustedError(
                    None, None, "OOM when allocating tensor (a test's)")
        return inputs


def _normalized_mlp(model_class, out_of_memory_above=None, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    if out_of_memory_above is not None:
        hidden = _OutOfMemoryAbove(out_of_memory_above)(hidden)
    if not ON_KERAS_2:
        hidden = keras.layers.BatchNormalization(name="norm")(hidden)
    return model_class(inputs, keras.layers.Dense(3)(hidden), **kwargs)


@pytest.mark.skipif(ON_JAX, reason="JAX sizes from the compiled step's "
                    "memory (tested below)")
@pytest.mark.parametrize("data", ["arrays", "dataset"])
@pytest.mark.filterwarnings("ignore:BatchNormalization layers")
def test_auto_backs_off_on_out_of_memory_before_any_update(data, capsys):
    # A pass on more than 24 samples runs out of memory: of the candidates
    # for batches of 64 (1, 2, 4, ..., 64), 16 is the largest that fits.
    # At learning rate 0 the moving statistics must be the large batch's:
    # the trials leave none of their own behind.
    x, y = regression_data(samples=160)
    plain = _normalized_mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    plain.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    model = _normalized_mlp(AccumulatingModel, out_of_memory_above=24,
                            micro_batch_size="auto")
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    if data == "dataset":
        if not ON_TENSORFLOW:
            pytest.skip("tf.data is TensorFlow's")
        import tensorflow as tf

        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(64),
                  epochs=2, shuffle=False, verbose=0)
    else:
        model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert "micro-batches of 16" in capsys.readouterr().out
    assert list(model._accumulation.chosen_micro_batch_sizes.values())[0] == 16
    assert iterations(model) == iterations(plain) == 6
    assert max_weight_difference(plain, model) <= TOLERANCE
    if not ON_KERAS_2:
        from test_batch_normalization import statistics

        for large, split in zip(statistics(plain), statistics(model)):
            np.testing.assert_allclose(split, large, atol=TOLERANCE)


@jax_only("the compiled step's memory")
def test_auto_takes_the_largest_micro_batch_whose_step_fits_the_limit(
        capsys):
    from accum_model.keras3.jax_adapter import step_bytes

    x, y = regression_data(samples=128)
    plain = mlp(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    plain.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    probe = mlp(AccumulatingModel, micro_batch_size=64)
    probe.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    probe.fit(x[:64], y[:64], batch_size=64, epochs=1, verbose=0)
    state = probe._get_jax_state(
        trainable_variables=True, non_trainable_variables=True,
        optimizer_variables=True, metrics_variables=True)
    held = {size: step_bytes(probe, state, (x[:64], y[:64]), size)
            for size in (8, 16)}
    assert held[8] < held[16]
    model = mlp(AccumulatingModel, micro_batch_size="auto",
                memory_limit=(held[8] + held[16]) // 2)
    model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    assert "micro-batches of 8" in capsys.readouterr().out
    assert list(model._accumulation.chosen_micro_batch_sizes.values()) == [8]
    assert iterations(model) == iterations(plain) == 2
    assert max_weight_difference(plain, model) <= TOLERANCE


@jax_only("the compiled step's memory")
def test_auto_on_a_device_of_unknown_memory_names_memory_limit():
    x, y = regression_data(samples=32)
    model = mlp(AccumulatingModel, micro_batch_size="auto")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="memory_limit=<bytes>"):
        model.fit(x, y, batch_size=16, verbose=0)
    assert iterations(model) == 0


def test_memory_limit_is_refused_without_auto():
    with pytest.raises(ValueError, match="memory_limit"):
        mlp(AccumulatingModel, micro_batch_size=8, memory_limit=2**20)
    with pytest.raises(ValueError, match="memory_limit"):
        mlp(AccumulatingModel, micro_batch_size="auto", memory_limit=-1)


@pytest.mark.skipif(not ON_TENSORFLOW, reason="TensorFlow chooses as fit() "
                    "starts")
def test_auto_on_tensorflow_refuses_what_it_cannot_size():
    x, y = regression_data(samples=32)
    model = mlp(AccumulatingModel, micro_batch_size="auto")
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(ValueError, match="call fit()"):
        model.train_on_batch(x[:16], y[:16])

    def batches():
        while True:
            yield x[:16], y[:16]

    with pytest.raises(ValueError, match="generator"):
        model.fit(batches(), steps_per_epoch=2, verbose=0)
    assert iterations(model) == 0


def test_mixed_float16_windows_of_batches_split_unevenly():
    # Windows of two batches of 16 split into 6 + 6 + 4, the epoch's last
    # window a batch of 16 and one of 8 (6 + 2): the window's micro-batches
    # differ in their share of it, under loss scaling too.
    x, y = regression_data(samples=56)
    plain, model, _, rounding = _mixed_float16_and_its_rounding(
        OPTIMIZERS["sgd"], x, y, batch_size=16, micro_batch_size=6,
        n_gradients=2, epochs=2)
    assert iterations(model) == iterations(plain) == 4
    assert max_weight_difference(model, plain) <= 2 * rounding + 1e-6


@pytest.mark.parametrize("n_gradients", [1, 2])
def test_the_noise_scale_is_measured_on_the_micro_batches(n_gradients):
    # Windows of n batches of 16, each split into 4 micro-batches of 4,
    # measure what windows of 4n micro-batches of 4 measure (with n = 1
    # too: the split gives a window of one batch its micro-batches).
    x, y = regression_data(samples=256)
    histories = []
    for settings, batch_size in (({"n_gradients": n_gradients,
                                   "micro_batch_size": 4}, 16),
                                 ({"n_gradients": 4 * n_gradients}, 4)):
        model = mlp(AccumulatingModel, measure_noise_scale=True, **settings)
        model.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
        histories.append(model.fit(x, y, batch_size=batch_size, epochs=2,
                                   shuffle=False, verbose=0).history)
    assert np.all(np.isfinite(histories[0]["noise_scale"]))
    np.testing.assert_allclose(histories[0]["noise_scale"],
                               histories[1]["noise_scale"], rtol=1e-4)


def test_replicas_split_uneven_shares_apart(two_replicas):
    # Batches of 7 split 4 and 3 on TensorFlow, each share into micro-
    # batches of 2 (2 + 2 and 2 + 1), and the last of 50 samples 1 and 0
    # (JAX splits batches of 8 equally): the replicas loop apart.
    batch_size = 7 if ON_TENSORFLOW else 8
    x, y = regression_data(samples=50)
    plain, model, plain_history, history = fit_split(
        mlp, OPTIMIZERS["sgd"], x, y, batch_size=batch_size,
        micro_batch_size=2, strategy=two_replicas)
    assert iterations(model) == iterations(plain) == 2 * -(-50 // batch_size)
    assert max_weight_difference(plain, model) <= TOLERANCE
    _assert_same_losses(plain_history, history)
