"""n micro-batches of b equal one batch of n*b: weights after fit() match."""

import warnings

import numpy as np
import pytest

from accum_model import AccumulatingModel
from backends import keras_2_too
from backends import keras_3_only
from backends import ON_KERAS_2
from backends import ON_TENSORFLOW
from backends import ON_TORCH
from backends import tensorflow_only
from helpers import keras
from helpers import classification_data
from helpers import fit_both
from helpers import iterations
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data
from helpers import skip_unless_executions_stop_cleanly

pytestmark = keras_2_too

# Where the test's own layers compute with `keras.ops`.
_KERAS_OPS = keras_3_only("the test's layers use keras.ops")

if ON_TENSORFLOW:
    import tensorflow as tf

TOLERANCE = 1e-5

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_momentum_nesterov": lambda: keras.optimizers.SGD(
        0.05, momentum=0.9, nesterov=True
    ),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adamw_weight_decay": lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.1
    ),
    "rmsprop_clipnorm": lambda: keras.optimizers.RMSprop(0.01, clipnorm=0.05),
    "adam_global_clipnorm": lambda: keras.optimizers.Adam(
        0.01, global_clipnorm=0.05
    ),
    "sgd_clipvalue": lambda: keras.optimizers.SGD(0.1, clipvalue=0.01),
    "adam_schedule_every_step": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(
            0.02, decay_steps=1, decay_rate=0.7
        )
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_match_large_batch(name):
    x, y = regression_data(samples=96)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS[name], x, y, micro_batch=8, n_gradients=4, epochs=2
    )
    assert iterations(accumulating) == iterations(plain) == 6
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_short_last_micro_batch():
    # 100 samples in micro-batches of 8: the 13th holds 4 samples and is a
    # window of its own, as the last large batch of 32 holds 4.
    x, y = regression_data(samples=100)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["sgd"], x, y, micro_batch=8, n_gradients=4, epochs=3
    )
    assert iterations(accumulating) == iterations(plain) == 12
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_short_last_window_of_several_micro_batches():
    # 90 samples: windows of 32, 32 and 26 (8+8+8+2) samples.
    x, y = regression_data(samples=90)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["adam"], x, y, micro_batch=8, n_gradients=4, epochs=2
    )
    assert iterations(accumulating) == iterations(plain) == 6
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_sample_weights():
    x, y = regression_data(samples=100)
    weights = np.random.default_rng(3).uniform(0.0, 3.0, size=100)
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["sgd"], x, y, micro_batch=8, n_gradients=4,
        fit_kwargs={"sample_weight": weights.astype("float32")},
    )
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_class_weights():
    x, y = classification_data(samples=100)
    plain, accumulating = fit_both(
        lambda cls, **kw: mlp(cls, outputs=4, activation="softmax", **kw),
        OPTIMIZERS["adam"], x, y, micro_batch=8, n_gradients=4,
        loss="sparse_categorical_crossentropy",
        fit_kwargs={"class_weight": {0: 1.0, 1: 3.0, 2: 0.5, 3: 2.0}},
    )
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


class OneHotEmbedding(keras.layers.Layer):
    """An Embedding whose gradient is dense: one-hot rows times the table."""

    def __init__(self, input_dim, output_dim, **kwargs):
        super().__init__(**kwargs)
        self.input_dim = input_dim
        self.embeddings = self.add_weight(
            shape=(input_dim, output_dim), initializer="uniform",
            name="embeddings",
        )

    def call(self, tokens):
        return keras.ops.matmul(
            keras.ops.one_hot(tokens, self.input_dim), self.embeddings
        )

    def compute_mask(self, tokens, mask=None):
        return keras.ops.not_equal(tokens, 0)


def _masked_lstm(model_class, n_gradients=None, vocabulary=12, seed=2,
                 dense_embedding=False):
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((None,), dtype="int32")
    if dense_embedding:
        embedded = OneHotEmbedding(vocabulary, 6)(tokens)
    else:
        embedded = keras.layers.Embedding(vocabulary, 6, mask_zero=True)(
            tokens
        )
    hidden = keras.layers.LSTM(8, return_sequences=True)(embedded)
    logits = keras.layers.Dense(vocabulary)(hidden)
    kwargs = {} if n_gradients is None else {"n_gradients": n_gradients}
    return model_class(inputs=tokens, outputs=logits, **kwargs)


def _padded_sequences(samples=64, max_length=10, vocabulary=12, seed=4):
    rng = np.random.default_rng(seed)
    # Lengths vary a lot between micro-batches, so their valid-token counts
    # (what Keras divides a masked loss by) differ too.
    lengths = rng.integers(1, max_length + 1, size=samples)
    x = np.zeros((samples, max_length), "int32")
    for i, length in enumerate(lengths):
        x[i, :length] = rng.integers(1, vocabulary, size=length)
    y = np.roll(x, -1, axis=1)
    y[x == 0] = 0
    return x, y


def _fit_masked_lstm(make_optimizer, plain_embedding_dense):
    x, y = _padded_sequences()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    plain = _masked_lstm(keras.Model, dense_embedding=plain_embedding_dense)
    plain.compile(optimizer=make_optimizer(), loss=loss)
    accumulating = _masked_lstm(AccumulatingModel, n_gradients=4)
    accumulating.compile(optimizer=make_optimizer(), loss=loss)
    accumulating.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    accumulating.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return plain, accumulating


def test_masked_lstm_on_padded_sequences():
    plain, accumulating = _fit_masked_lstm(OPTIMIZERS["sgd"], False)
    assert iterations(accumulating) == iterations(plain) == 4
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


@_KERAS_OPS
def test_masked_lstm_with_adam_matches_the_dense_embedding_gradient():
    # Keras 3 hands Adam an Embedding gradient as IndexedSlices and squares
    # each occurrence of a repeated token separately, so its result depends
    # on how the same gradient is represented. The accumulated gradient is
    # the exact (dense) gradient of the window, so the reference is the
    # large batch computed with a dense embedding gradient.
    plain, accumulating = _fit_masked_lstm(OPTIMIZERS["adam"], True)
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


@_KERAS_OPS
@pytest.mark.parametrize("clipping", ["clipvalue", "clipnorm",
                                      "global_clipnorm"])
def test_clipped_embedding_gradient_matches_the_dense_embedding_gradient(
        clipping):
    # Keras 3 on TensorFlow clips an Embedding's IndexedSlices gradient
    # occurrence by occurrence of a repeated token (found by tests/fuzz.py):
    # the window clips the dense gradient of the large batch.
    value = {"clipvalue": 0.01, "clipnorm": 0.1, "global_clipnorm": 0.1}
    plain, accumulating = _fit_masked_lstm(
        lambda: keras.optimizers.SGD(0.5, **{clipping: value[clipping]}),
        True)
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def _two_inputs(model_class, n_gradients=None, seed=5):
    keras.utils.set_random_seed(seed)
    left = keras.Input((4,), name="left")
    right = keras.Input((3,), name="right")
    merged = keras.layers.Concatenate()(
        [keras.layers.Dense(5, activation="relu")(left), right]
    )
    output = keras.layers.Dense(2)(merged)
    kwargs = {} if n_gradients is None else {"n_gradients": n_gradients}
    return model_class(inputs=[left, right], outputs=output, **kwargs)


@tensorflow_only("tf.data")
def test_two_inputs_from_tf_data():
    rng = np.random.default_rng(6)
    left = rng.normal(size=(88, 4)).astype("float32")
    right = rng.normal(size=(88, 3)).astype("float32")
    y = rng.normal(size=(88, 2)).astype("float32")

    def dataset(batch):
        return tf.data.Dataset.from_tensor_slices(((left, right), y)).batch(
            batch
        )

    plain = _two_inputs(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    plain.fit(dataset(24), epochs=2, verbose=0)
    accumulating = _two_inputs(AccumulatingModel, n_gradients=3)
    accumulating.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    accumulating.set_weights(_two_inputs(keras.Model).get_weights())
    accumulating.fit(dataset(8), epochs=2, verbose=0)
    assert iterations(accumulating) == iterations(plain) == 8
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def test_dict_inputs_and_two_outputs():
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(7)
    x = {
        "a": rng.normal(size=(64, 3)).astype("float32"),
        "b": rng.normal(size=(64, 2)).astype("float32"),
    }
    y = {
        "out1": rng.normal(size=(64, 2)).astype("float32"),
        "out2": rng.integers(0, 3, size=(64,)).astype("int32"),
    }

    def build(model_class, n_gradients=None):
        keras.utils.set_random_seed(8)
        a = keras.Input((3,), name="a")
        b = keras.Input((2,), name="b")
        h = keras.layers.Dense(6, activation="tanh")(
            keras.layers.Concatenate()([a, b])
        )
        out1 = keras.layers.Dense(2, name="out1")(h)
        out2 = keras.layers.Dense(3, activation="softmax", name="out2")(h)
        kwargs = {} if n_gradients is None else {"n_gradients": n_gradients}
        return model_class(
            inputs={"a": a, "b": b}, outputs={"out1": out1, "out2": out2},
            **kwargs,
        )

    losses = {"out1": "mse", "out2": "sparse_categorical_crossentropy"}
    plain, accumulating = fit_both(
        build, OPTIMIZERS["adam"], x, y, micro_batch=8, n_gradients=4,
        loss=losses,
    )
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


@pytest.mark.parametrize(
    "compile_kwargs",
    [{"jit_compile": True}, {"steps_per_execution": 3},
     {"run_eagerly": True}],
    ids=["jit_compile", "steps_per_execution", "run_eagerly"],
)
def test_compile_modes(compile_kwargs):
    skip_unless_executions_stop_cleanly(
        compile_kwargs.get("steps_per_execution", 1))
    x, y = regression_data(samples=100)
    if ON_TORCH and compile_kwargs.get("jit_compile"):
        # torch.compile of the step is refused before training.
        model = mlp(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse",
                      jit_compile=True)
        with pytest.raises(ValueError, match="jit_compile=False"):
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        assert iterations(model) == 0
        return
    # The reference runs one step per call: keras 3.6's Python loop over
    # executions makes extra updates at the end of the data (10, not 8).
    plain, accumulating = fit_both(
        mlp, OPTIMIZERS["adam"], x, y, micro_batch=8, n_gradients=4,
        compile_kwargs=compile_kwargs,
        plain_compile_kwargs={k: v for k, v in compile_kwargs.items()
                              if k != "steps_per_execution"},
    )
    assert iterations(accumulating) == iterations(plain) == 8
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


# Keras 3's (Keras 2 has `keras.utils.Sequence`).
_PyDataset = getattr(keras.utils, "PyDataset", object)


class _Batches(_PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return int(np.ceil(len(self.x) / self.batch_size))

    def __getitem__(self, index):
        window = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[window], self.y[window]


def _generator(x, y, batch_size):
    for start in range(0, len(x), batch_size):
        yield x[start:start + batch_size], y[start:start + batch_size]


@pytest.mark.parametrize("source", [
    pytest.param("py_dataset", marks=keras_3_only("keras.utils.PyDataset")),
    "generator"])
def test_python_data_sources(source):
    x, y = regression_data(samples=100)

    def make(batch):
        if source == "py_dataset":
            return _Batches(x, y, batch)
        return _generator(x, y, batch)

    # The reference reads the same data as arrays: with a generator, plain
    # Keras 3.15.1 counts one update more than the batches it was given.
    plain = mlp(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    accumulating = mlp(AccumulatingModel, n_gradients=4)
    accumulating.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse")
    accumulating.fit(make(8), epochs=1, shuffle=False, verbose=0)
    assert iterations(accumulating) == iterations(plain) == 4
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


class SubclassedNet(AccumulatingModel):
    def __init__(self, n_gradients=4, **kwargs):
        super().__init__(n_gradients=n_gradients, **kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


def test_subclassed_model_matches_large_batch():
    x, y = regression_data(samples=96)
    keras.utils.set_random_seed(11)
    accumulating = SubclassedNet(n_gradients=4)
    accumulating(x[:1])
    plain = mlp(keras.Model)
    plain.set_weights(accumulating.get_weights())
    plain.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    accumulating.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    accumulating.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def _regularized(model_class, n_gradients=None, seed=12):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05)
    )(inputs)
    outputs = keras.layers.Dense(3)(hidden)
    kwargs = {} if n_gradients is None else {"n_gradients": n_gradients}
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def _spectral_mlp(model_class, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.SpectralNormalization(
        keras.layers.Dense(8, activation="tanh"), name="spectral")(inputs)
    return model_class(inputs=inputs, outputs=keras.layers.Dense(3)(hidden),
                       **kwargs)


@pytest.mark.parametrize("source", ["arrays", "generator"])
def test_spectral_normalization_renormalizes_once_per_window(source):
    # Keras's layer renormalizes its kernel in every training call, the
    # large batch's once per step. A window's weights do not change before
    # its end, so it renormalizes once and stays the large batch
    # (renormalizing in every micro step, it landed 0.18 away). Windows of
    # 3, 3 and a last one of 1, the last applied in the step (arrays) or
    # after it, the epoch's length unknown (a generator). Where it cannot
    # (Keras 2), fit() names the layer.
    x, y = regression_data(samples=56)
    probe = _spectral_mlp(keras.Model)
    probe.compile(optimizer="sgd", loss="mse")
    try:
        probe.fit(x, y, batch_size=8, epochs=1, verbose=0)
    except Exception as error:  # Keras 2.13.1's layer: a tensor as a bool.
        pytest.skip(f"plain Keras cannot train SpectralNormalization here: "
                    f"{type(error).__name__}")
    plain = _spectral_mlp(keras.Model)
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    plain.fit(x, y, batch_size=24, epochs=2, shuffle=False, verbose=0)
    model = _spectral_mlp(AccumulatingModel, n_gradients=3)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.set_weights(_spectral_mlp(keras.Model).get_weights())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if source == "arrays":
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                      verbose=0)
        else:
            for _ in range(2):
                model.fit(_generator(x, y, 8), epochs=1, verbose=0)
    named = [str(w.message) for w in caught
             if "SpectralNormalization" in str(w.message)]
    if ON_KERAS_2:
        assert len(named) == 1
        assert "['spectral']" in named[0]
    else:
        assert not named
        assert iterations(model) == iterations(plain) == 6
        assert max_weight_difference(plain, model) <= TOLERANCE


def test_weight_regularization_counts_once_per_window():
    # The regularization loss is added to every micro-batch loss; weighted
    # by micro-batch size it adds up to once per window, as in the large
    # batch.
    x, y = regression_data(samples=100)
    plain, accumulating = fit_both(
        _regularized, OPTIMIZERS["sgd"], x, y, micro_batch=8, n_gradients=4,
    )
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def _executing_eagerly(tensor):
    if ON_TENSORFLOW:
        return tf.executing_eagerly()
    if ON_TORCH:
        return True
    import jax

    return not isinstance(tensor, jax.core.Tracer)


def _branching_net(base, n_gradients=None):
    """A subclassed net with a layer that only training, or some samples, use.

    `extra` runs only under `training=True`, and in eager mode only when
    some sample of the batch needs it (a Python branch), so some
    micro-batches give it no gradient at all.
    """

    class Branching(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(8, activation="tanh")
            self.out = keras.layers.Dense(3)
            self.extra = keras.layers.Dense(3)

        def call(self, inputs, training=False):
            outputs = self.out(self.hidden(inputs))
            if not training:
                return outputs
            needs = keras.ops.cast(inputs[:, :1] > 1.2, outputs.dtype)
            if _executing_eagerly(needs) and not bool(
                    keras.ops.any(needs > 0)):
                return outputs
            return outputs + needs * self.extra(inputs)

    keras.utils.set_random_seed(21)
    kwargs = {} if n_gradients is None else {"n_gradients": n_gradients}
    return Branching(**kwargs)


@tensorflow_only("plain Keras on JAX builds the optimizer before a layer "
                 "used only in training exists, and its fit() refuses")
@_KERAS_OPS
@pytest.mark.parametrize("before_fit", ["build", "predict", "evaluate"])
def test_model_used_before_fit_trains_every_weight(before_fit):
    x, y = regression_data(samples=96)
    models = []
    for base, kwargs in ((keras.Model, {}), (AccumulatingModel,
                                             {"n_gradients": 4})):
        model = _branching_net(base, **kwargs)
        model.compile(optimizer=OPTIMIZERS["adam"](), loss="mse")
        if before_fit == "build":
            model.build((None, 6))
        elif before_fit == "predict":
            model.predict(x[:8], verbose=0)
        else:
            model.evaluate(x[:8], y[:8], verbose=0)
        models.append(model)
    plain, accumulating = models
    accumulating.set_weights(plain.get_weights())
    plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    accumulating.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    assert iterations(accumulating) == iterations(plain) == 6
    assert len(accumulating.trainable_weights) == 6
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


@_KERAS_OPS
def test_eager_window_keeps_gradients_only_some_micro_batches_have():
    x, y = regression_data(samples=64)
    # The last micro-batch of the first window needs no `extra`.
    x[24:32, 0] = -1.0
    x[:24, 0] = np.where(np.arange(24) % 5 == 0, 2.0, x[:24, 0])
    plain = _branching_net(keras.Model)
    plain.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse", run_eagerly=True)
    accumulating = _branching_net(AccumulatingModel, n_gradients=4)
    accumulating.compile(optimizer=OPTIMIZERS["sgd"](), loss="mse",
                         run_eagerly=True)
    plain(x[:1], training=True)
    accumulating(x[:1], training=True)
    accumulating.set_weights(plain.get_weights())
    extra_before = plain.extra.kernel.numpy().copy()
    plain.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    accumulating.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert not np.array_equal(extra_before, plain.extra.kernel.numpy())
    assert iterations(accumulating) == iterations(plain) == 2
    assert max_weight_difference(plain, accumulating) <= TOLERANCE


def _sometimes_unused_net(base, n_gradients=None):
    """A subclassed net whose `extra` layer the loss uses only while its
    `uses_extra` attribute is set (a Python branch)."""

    class SometimesUnused(base):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(8, activation="tanh")
            self.out = keras.layers.Dense(3)
            self.extra = keras.layers.Dense(3)
            self.uses_extra = True

        def call(self, inputs, training=False):
            outputs = self.out(self.hidden(inputs))
            if self.uses_extra:
                outputs = outputs + self.extra(inputs)
            return outputs

    keras.utils.set_random_seed(22)
    kwargs = {} if n_gradients is None else {"n_gradients": n_gradients}
    model = SometimesUnused(**kwargs)
    model(np.zeros((1, 6), "float32"))
    return model


def test_weights_the_loss_stops_using_move_as_in_the_large_batch():
    # After one epoch with `extra`, windows in which no micro-batch gives
    # it a gradient: the large batch's optimizer sees its gradient as the
    # backend gives it (none, or zeros), with Adam's moments and weight
    # decay then moving it or not; the window must do the same.
    x, y = regression_data(samples=64)
    make_optimizer = lambda: keras.optimizers.Adam(0.01, weight_decay=0.1)

    def train(model, batch_size):
        model.compile(optimizer=make_optimizer(), loss="mse")
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                  verbose=0)
        model.uses_extra = False
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                  verbose=0)

    plain = _sometimes_unused_net(keras.Model)
    train(plain, 32)
    model = _sometimes_unused_net(AccumulatingModel, n_gradients=4)
    model.set_weights(_sometimes_unused_net(keras.Model).get_weights())
    train(model, 8)
    assert iterations(model) == iterations(plain) == 4
    assert max_weight_difference(plain, model) <= TOLERANCE
