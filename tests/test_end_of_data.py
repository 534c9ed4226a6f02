"""The end of the data: empty steps are no micro steps, empty windows no update.

Keras learns that data of unknown length has ended only when a step finds no
data, and `tf.distribute` can hand every replica an empty batch for that
step. Those failures depend on when the end is noticed, so each case runs
several trials.
"""

import numpy as np
import pytest

from accum_model import AccumulatingModel
from backends import keras_2_too
from backends import keras_3_only
from backends import ON_TENSORFLOW
from backends import tensorflow_only
from helpers import keras
from helpers import fit_both
from helpers import iterations
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data
from helpers import windows_reference
from helpers import skip_unless_executions_stop_cleanly

pytestmark = keras_2_too

if ON_TENSORFLOW:
    import tensorflow as tf

TRIALS = 3


def _generator(x, y, micro_batch):
    for start in range(0, len(x), micro_batch):
        yield x[start:start + micro_batch], y[start:start + micro_batch]


def _sources(x, y, micro_batch):
    def signature():
        return (tf.TensorSpec((None, x.shape[1])),
                tf.TensorSpec((None, y.shape[1])))

    return {
        "python_generator": lambda: _generator(x, y, micro_batch),
        "from_generator": lambda: tf.data.Dataset.from_generator(
            lambda: _generator(x, y, micro_batch),
            output_signature=signature(),
        ),
        "unknown_cardinality": lambda: tf.data.Dataset.from_tensor_slices(
            (x, y)
        ).filter(lambda a, b: True).batch(micro_batch),
    }


TF_DATA = tensorflow_only("tf.data")


@pytest.mark.parametrize("source", [
    "python_generator", pytest.param("from_generator", marks=TF_DATA),
    pytest.param("unknown_cardinality", marks=TF_DATA)])
@pytest.mark.parametrize("flush_each_epoch", [True, False])
def test_data_of_unknown_length_stays_exact(source, flush_each_epoch):
    # 40 samples, micro-batches of 8, windows of 2: 2 full windows and one
    # of a single micro-batch per epoch; the generator is good for 1 epoch.
    x, y = regression_data(samples=40)
    epochs = 1 if source == "python_generator" else 2
    micro = [list(range(i, i + 8)) for i in range(0, 40, 8)] * epochs
    if flush_each_epoch:
        windows = [sum(micro[i:i + 2], []) for i in (0, 2)] + [micro[4]]
        windows = windows * epochs
    else:
        windows = [sum(micro[i:i + 2], []) for i in range(0, len(micro), 2)]
    plain = windows_reference(x, y, windows, keras.optimizers.Adam(0.01))
    for _ in range(TRIALS):
        model = mlp(AccumulatingModel, n_gradients=2,
                    flush_each_epoch=flush_each_epoch)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        data = _sources(x, y, 8)[source]()
        model.fit(data, epochs=epochs, verbose=0)
        assert iterations(model) == len(windows)
        assert max_weight_difference(plain, model) <= 1e-6


@TF_DATA
@keras_3_only("Keras 2 refuses empty data itself")
@pytest.mark.parametrize("steps_per_execution", [1, 3])
def test_empty_data_leaves_weights_bit_identical(steps_per_execution):
    skip_unless_executions_stop_cleanly(steps_per_execution)
    x, y = regression_data(samples=16)
    for _ in range(TRIALS):
        model = mlp(AccumulatingModel, n_gradients=2)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse",
                      steps_per_execution=steps_per_execution)
        before = model.get_weights()
        empty = tf.data.Dataset.from_tensor_slices((x, y)).take(0).batch(8)
        model.fit(empty, epochs=2, verbose=0)
        assert iterations(model) == 0
        for a, b in zip(before, model.get_weights()):
            np.testing.assert_array_equal(a, b)


@keras_3_only("Keras 2 refuses data of unknown length with "
              "steps_per_execution > 1 itself")
@pytest.mark.parametrize("source", [
    "python_generator", pytest.param("unknown_cardinality", marks=TF_DATA)])
def test_unknown_length_with_steps_per_execution(source):
    skip_unless_executions_stop_cleanly()
    x, y = regression_data(samples=56)  # 7 micro-batches of 8
    micro = [list(range(i, i + 8)) for i in range(0, 56, 8)]
    windows = [sum(micro[i:i + 2], []) for i in range(0, 7, 2)]
    plain = windows_reference(x, y, windows, keras.optimizers.SGD(0.1))
    for _ in range(TRIALS):
        model = mlp(AccumulatingModel, n_gradients=2)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      steps_per_execution=3)
        data = _sources(x, y, 8)[source]()
        model.fit(data, epochs=1, verbose=0)
        assert iterations(model) == 4
        assert max_weight_difference(plain, model) <= 1e-6


def test_window_of_fully_masked_micro_batches_steps_like_keras():
    # Every target is masked out: Keras's loss is 0 (divide_no_nan) and the
    # optimizer still takes a step with a zero gradient, which moves Adam's
    # moments and counts an iteration; so must the window, without NaN.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 5, 3)).astype("float32")
    x[:, :, :] = 0.0  # every time step masked

    def build(model_class, **kwargs):
        keras.utils.set_random_seed(3)
        inputs = keras.Input((5, 3))
        masked = keras.layers.Masking(0.0)(inputs)
        outputs = keras.layers.LSTM(4, return_sequences=True)(masked)
        return model_class(inputs=inputs, outputs=outputs, **kwargs)

    y = rng.normal(size=(32, 5, 4)).astype("float32")
    plain = build(keras.Model)
    plain.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.5),
                  loss="mse")
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    model = build(AccumulatingModel, n_gradients=4)
    model.compile(optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.5),
                  loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert iterations(model) == iterations(plain) == 2
    assert all(np.isfinite(w).all() for w in model.get_weights())
    assert max_weight_difference(plain, model) <= 1e-6


def _padded_tokens():
    """Token sequences padded with 0: the third micro-batch of 8 is
    nothing but padding in its first half (one replica's share of two), the
    fourth in all of it."""
    rng = np.random.default_rng(4)
    x = rng.integers(1, 20, size=(32, 6)).astype("int32")
    x[rng.random(size=x.shape) < 0.3] = 0
    x[16:20] = 0
    x[24:32] = 0
    y = rng.normal(size=(32, 6, 3)).astype("float32")
    return x, y


def _token_model(model_class, **kwargs):
    keras.utils.set_random_seed(6)
    inputs = keras.Input((6,), dtype="int32")
    embedded = keras.layers.Embedding(20, 4, mask_zero=True)(inputs)
    outputs = keras.layers.Dense(3)(embedded)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_micro_batch_of_padding_alone_adds_nothing(replicas, policy,
                                                   request):
    # Keras 2 divides a masked mean by its valid elements, 0 here: its loss
    # is NaN, and so was every weight after the window (or, under loss
    # scaling, the window was skipped). The large batch has valid elements.
    strategy = (request.getfixturevalue("two_replicas") if replicas == 2
                else None)
    x, y = _padded_tokens()
    keras.mixed_precision.set_global_policy(policy)
    plain, model = fit_both(_token_model, lambda: keras.optimizers.SGD(0.5),
                            x, y, micro_batch=8, n_gradients=2,
                            strategy=strategy)
    assert iterations(model) == iterations(plain) == 4
    assert model.skipped_windows == 0
    assert all(np.isfinite(w).all() for w in model.get_weights())
    tolerance = 1e-6 if policy == "float32" else 1e-3
    assert max_weight_difference(plain, model) <= tolerance


@tensorflow_only("the traced function that applies an open window")
def test_the_open_window_is_applied_by_a_trace_without_autograph():
    # After some hundred models in one process (the fuzzer, then the mixed
    # precision tests, under tf-keras 2.21 and Keras 3 on TensorFlow),
    # AutoGraph's conversion of this function returned a `tf.function`
    # from its trace and `apply_open_window()` raised a TypeError. Its
    # branches are `tf.cond`s already: it needs no conversion.
    x, y = regression_data(samples=16)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x[:8], y[:8], batch_size=4, epochs=1, verbose=0,
              steps_per_epoch=2)
    function = model._accumulation.window_end._make_apply_open()
    assert isinstance(function, tf.types.experimental.PolymorphicFunction)
    assert function._autograph is False
