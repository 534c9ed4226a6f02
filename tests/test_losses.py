"""Every loss Keras ships, every reduction, masks however made: exact.

Windows mix micro-batches whose divisors differ a lot (short and long
sequences, many and few ignored tokens), where weighting them equally or by
sample count would be visibly wrong.
"""

import contextlib
import warnings


import keras
import numpy as np
import pytest

from accum_model import AccumulatingModel
from helpers import iterations
from helpers import max_weight_difference
from helpers import mlp
from helpers import regression_data

TOLERANCE = 1e-5
VOCABULARY = 7


def _token_data(samples=64, steps=10, seed=0):
    """Token sequences padded with 0; lengths alternate short and long."""
    rng = np.random.default_rng(seed)
    lengths = np.where(np.arange(samples) % 16 < 8, 2, steps)
    x = rng.normal(size=(samples, steps, 3)).astype("float32")
    y = rng.integers(1, VOCABULARY, size=(samples, steps)).astype("int32")
    for row, length in enumerate(lengths):
        x[row, length:] = 0.0
        y[row, length:] = 0
    return x, y


def _tagger(model_class, masking=False, **kwargs):
    keras.utils.set_random_seed(8)
    inputs = keras.Input((None, 3))
    hidden = keras.layers.Masking(0.0)(inputs) if masking else inputs
    hidden = keras.layers.Dense(8, activation="tanh")(hidden)
    outputs = keras.layers.Dense(VOCABULARY)(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def _fit_both(build, loss, x, y, strategy=None, sample_weight=None,
              make_optimizer=lambda: keras.optimizers.Adam(0.01), epochs=2):
    plain = build(keras.Model)
    plain.compile(optimizer=make_optimizer(), loss=loss)
    plain.fit(x, y, sample_weight=sample_weight, batch_size=32,
              epochs=epochs, shuffle=False, verbose=0)
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model = build(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=make_optimizer(), loss=loss)
    model.set_weights(build(keras.Model).get_weights())
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.fit(x, y, sample_weight=sample_weight, batch_size=8,
                  epochs=epochs, shuffle=False, verbose=0)
    return plain, model


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("masking", [False, True])
def test_ignore_class_matches_large_batch(replicas, masking, two_replicas):
    # Keras divides by the tokens not ignored (and, with a Keras mask too,
    # by those valid under both): 2 per sequence in half the micro-batches,
    # 10 in the others.
    x, y = _token_data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      ignore_class=0)
    plain, model = _fit_both(
        lambda c, **k: _tagger(c, masking=masking, **k), loss, x, y,
        strategy=two_replicas if replicas == 2 else None)
    assert iterations(model) == iterations(plain) == 4
    assert max_weight_difference(plain, model) <= TOLERANCE


@pytest.mark.parametrize("reduction", ["sum", "mean_with_sample_weight",
                                       "sum_over_batch_size"])
@pytest.mark.parametrize("replicas", [1, 2])
def test_every_reduction_matches_large_batch(reduction, replicas,
                                             two_replicas):
    x, y = regression_data(samples=100)
    weights = np.where(np.arange(100) % 16 < 8, 0.1, 3.0).astype("float32")
    try:
        loss = keras.losses.MeanSquaredError(reduction=reduction)
    except ValueError:
        pytest.skip(f"this Keras has no reduction={reduction!r}")
    plain, model = _fit_both(
        mlp, loss, x, y, sample_weight=weights,
        strategy=two_replicas if replicas == 2 else None,
        make_optimizer=lambda: keras.optimizers.SGD(
            0.001 if reduction == "sum" else 0.1))
    assert iterations(model) == iterations(plain) == 8
    assert max_weight_difference(plain, model) <= TOLERANCE


def _weighted_mean_loss(**kwargs):
    try:
        return keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, reduction="mean_with_sample_weight", **kwargs)
    except ValueError:
        pytest.skip("this Keras has no reduction='mean_with_sample_weight'")


def _classifier(model_class, **kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(6, activation="tanh")(inputs)
    return model_class(inputs, keras.layers.Dense(VOCABULARY)(hidden),
                       **kwargs)


@pytest.mark.parametrize("case", ["ignore_class_per_step",
                                  "ignore_class_per_sample",
                                  "keras_mask_per_step"])
def test_a_weighted_mean_with_a_mask_matches_large_batch(case):
    # The mean divides by the sample weights times the mask (the loss's own
    # mask, or the prediction's Keras mask); Keras merges the two in place.
    from test_exactness import _masked_lstm
    from test_exactness import _padded_sequences

    rng = np.random.default_rng(1)
    x, y = _token_data()
    per_step = rng.uniform(0.1, 3.0, size=y.shape).astype("float32")
    if case == "ignore_class_per_step":
        build, loss, weights = _tagger, _weighted_mean_loss(ignore_class=0), \
            per_step
    elif case == "ignore_class_per_sample":
        x, y = x[:, 0], y[:, 0].copy()
        y[::3] = 0
        build, loss = _classifier, _weighted_mean_loss(ignore_class=0)
        weights = rng.uniform(0.1, 3.0, size=len(y)).astype("float32")
    else:
        # Adam against the large batch with a dense Embedding gradient:
        # Keras's Adam treats a repeated row of a sparse one separately
        # (see test_exactness.py), which is not the reference.
        x, y = _padded_sequences()
        loss, weights = _weighted_mean_loss(), per_step
        plain = _masked_lstm(keras.Model, dense_embedding=True)
        plain.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
        model = _masked_lstm(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss=loss)
        model.set_weights(plain.get_weights())
        plain.fit(x, y, sample_weight=weights, batch_size=32, epochs=2,
                  shuffle=False, verbose=0)
        model.fit(x, y, sample_weight=weights, batch_size=8, epochs=2,
                  shuffle=False, verbose=0)
        assert iterations(model) == iterations(plain) == 4
        assert max_weight_difference(plain, model) <= TOLERANCE
        return
    plain, model = _fit_both(build, loss, x, y, sample_weight=weights)
    assert iterations(model) == iterations(plain) == 4
    assert max_weight_difference(plain, model) <= TOLERANCE


def _per_element_squared_error(y_true, y_pred):
    return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


class _SquaredError(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_true - y_pred), axis=-1)


@pytest.mark.parametrize("loss", [_per_element_squared_error,
                                  _SquaredError()])
def test_functions_and_loss_subclasses_match_large_batch(loss):
    x, y = regression_data(samples=100)
    plain, model = _fit_both(mlp, loss, x, y)
    assert iterations(model) == iterations(plain) == 8
    assert max_weight_difference(plain, model) <= TOLERANCE


def _scalar_mean(y_true, y_pred):
    """The mean a loss of one's own often returns as one number."""
    return keras.ops.mean(keras.ops.square(y_true - y_pred))


def test_a_scalar_mean_of_ones_own_is_exact_and_quiet():
    # fit() tries the function on generated batches, finds the mean over
    # samples that the window weighs exactly, and says nothing.
    x, y = regression_data(samples=64)
    plain, model = _fit_both(mlp, _scalar_mean, x, y)
    assert iterations(model) == iterations(plain) == 4
    assert max_weight_difference(plain, model) <= TOLERANCE


def test_a_scalar_mean_of_ones_own_is_exact_and_quiet_on_replicas(
        two_replicas):
    x, y = regression_data(samples=64)
    plain, model = _fit_both(mlp, _scalar_mean, x, y, strategy=two_replicas)
    assert max_weight_difference(plain, model) <= TOLERANCE


def test_a_scalar_mean_under_sample_weights_is_warned_about():
    # Keras multiplies the one number by each sample's weight: no longer a
    # mean the window can weigh.
    x, y = regression_data(samples=64)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss=_scalar_mean)
    with pytest.warns(UserWarning, match="`_scalar_mean` returns one number"):
        model.fit(x, y, sample_weight=np.linspace(0.5, 2.0, 64),
                  batch_size=8, epochs=1, verbose=0)


def _masked_regression_mean(y_true, y_pred):
    """A mean over the targets that are not 0 (padding), as one number."""
    mask = keras.ops.cast(keras.ops.not_equal(y_true, 0), "float32")
    return (keras.ops.sum(mask * keras.ops.square(y_true - y_pred))
            / keras.ops.sum(mask))


def _scalar_sum(y_true, y_pred):
    return keras.ops.sum(keras.ops.square(y_true - y_pred))


class _ScalarSum(keras.losses.Loss):
    def call(self, y_true, y_pred):
        return keras.ops.sum(keras.ops.square(y_true - y_pred))


def _valid_tokens(y):
    return keras.ops.sum(keras.ops.cast(keras.ops.not_equal(y, 0),
                                        "float32"))


def _masked_token_mean(y_true, y_pred):
    """The token mean sequence code often writes by hand (0 pads)."""
    losses = keras.losses.sparse_categorical_crossentropy(
        y_true, y_pred, from_logits=True)
    mask = keras.ops.cast(keras.ops.not_equal(y_true, 0), losses.dtype)
    return keras.ops.sum(mask * losses) / keras.ops.sum(mask)


class TokenMeanModel(AccumulatingModel):
    """The way out the warning names for a masked mean."""

    def micro_batch_weight(self, x, y, y_pred, sample_weight):
        return _valid_tokens(y)


@pytest.mark.parametrize("loss, name", [
    (_scalar_sum, "_scalar_sum"), (_ScalarSum(), "_ScalarSum"),
    (_masked_token_mean, "_masked_token_mean"),
    (_masked_regression_mean, "_masked_regression_mean")])
def test_a_scalar_loss_of_ones_own_is_warned_about_by_name(loss, name):
    # One number per micro-batch: a sum or a mean of unknown divisor.
    if name == "_masked_token_mean":
        x, y = _token_data()
        model = _tagger(AccumulatingModel, n_gradients=4)
    else:
        x, y = regression_data(samples=64)
        model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss=loss)
    with pytest.warns(UserWarning, match=f"`{name}` returns one number.*"
                      "reduction='sum'.*`micro_batch_weight`"):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_the_ways_out_of_a_scalar_loss_are_exact():
    # A sum declared as one (reduction="sum"), and a masked mean weighted
    # by its own divisor, train as the large batch, with no warning.
    x, y = regression_data(samples=64)
    plain, model = _fit_both(mlp, _ScalarSum(reduction="sum"), x, y,
                             make_optimizer=lambda: keras.optimizers.SGD(
                                 0.002))
    assert max_weight_difference(plain, model) <= TOLERANCE
    x, y = _token_data()
    plain, model = _fit_both(
        lambda c, **k: _tagger(
            TokenMeanModel if c is AccumulatingModel else c, **k),
        _masked_token_mean, x, y)
    assert iterations(model) == iterations(plain) == 4
    assert max_weight_difference(plain, model) <= TOLERANCE


def _segmenter(model_class, **kwargs):
    keras.utils.set_random_seed(6)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(3, activation="sigmoid")(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


@pytest.mark.parametrize("make_loss", [
    lambda: keras.losses.Dice(), lambda: keras.losses.Tversky(),
    lambda: keras.losses.dice], ids=["Dice", "Tversky", "dice"])
def test_keras_losses_over_the_whole_batch_are_warned_about(make_loss):
    try:
        loss = make_loss()
    except AttributeError:
        pytest.skip("this Keras has no Dice or Tversky loss")
    x, y = regression_data(samples=64)
    model = _segmenter(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss=loss)
    name = "dice" if loss is keras.losses.dice else type(loss).__name__
    with pytest.warns(UserWarning, match=f"`{name}` computes one value over "
                      r"the whole batch.*axis=\(1, 2, 3\)"):
        model.fit(x, (y > 0).astype("float32"), batch_size=8, epochs=1,
                  verbose=0)


@pytest.mark.parametrize("build, loss", [
    (_segmenter, "dice_axis"), (None, "mse")], ids=["dice_axis", "mse"])
def test_keras_losses_per_sample_are_exact_without_warning(build, loss):
    # Dice over each sample's own axis; a Keras loss on a prediction of
    # shape (batch,), a scalar that is the batch's mean.
    from helpers import scalar_output_mlp

    x, y = regression_data(samples=64)
    if loss == "dice_axis":
        if not hasattr(keras.losses, "Dice"):
            pytest.skip("this Keras has no Dice loss")
        loss, y = keras.losses.Dice(axis=(1,)), (y > 0).astype("float32")
    else:
        build, y = scalar_output_mlp, y[:, 0]
    plain, model = _fit_both(build, loss, x, y)
    assert max_weight_difference(plain, model) <= TOLERANCE


def test_a_loss_comparing_samples_within_the_batch_is_warned_about():
    if not hasattr(keras.losses, "Circle"):
        pytest.skip("this Keras has no Circle loss")
    x, _ = regression_data(samples=64)
    labels = (np.arange(64) % 4).astype("int32")
    keras.utils.set_random_seed(6)
    inputs = keras.Input((6,))
    embedded = keras.layers.UnitNormalization()(keras.layers.Dense(4)(inputs))
    model = AccumulatingModel(inputs, embedded, n_gradients=4)
    model.compile(optimizer="sgd", loss=keras.losses.Circle())
    with pytest.warns(UserWarning, match="`Circle` compares each sample"):
        model.fit(x, labels, batch_size=8, epochs=1, verbose=0)


def _two_outputs(model_class, **kwargs):
    keras.utils.set_random_seed(9)
    inputs = keras.Input((None, 3))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    tags = keras.layers.Dense(VOCABULARY, name="tags")(hidden)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    score = keras.layers.Dense(1, name="score")(pooled)
    return model_class(inputs=inputs, outputs={"tags": tags, "score": score},
                       **kwargs)


def test_outputs_with_proportional_divisors_are_exact():
    x, y = _token_data()
    targets = {"tags": y, "score": x[:, :1, 0]}
    loss = {"tags": keras.losses.SparseCategoricalCrossentropy(
        from_logits=True), "score": "mse"}
    plain, model = _fit_both(_two_outputs, loss, x, targets)
    assert max_weight_difference(plain, model) <= TOLERANCE


def test_outputs_whose_divisors_differ_are_warned_about():
    x, y = _token_data()
    targets = {"tags": y, "score": x[:, :1, 0]}
    loss = {"tags": keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0), "score": "mse"}
    model = _two_outputs(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss=loss)
    with pytest.warns(UserWarning, match="micro_batch_weight"):
        model.fit(x, targets, batch_size=8, epochs=1, verbose=0)


def _fit_histories(build, loss, x, y, sample_weight=None, strategy=None,
                   make_optimizer=lambda: keras.optimizers.Adam(0.01)):
    """Epoch losses of plain Keras (batches of 32) and of windows of 4 x 8."""
    plain = build(keras.Model)
    plain.compile(optimizer=make_optimizer(), loss=loss)
    plain_history = plain.fit(x, y, sample_weight=sample_weight,
                              batch_size=32, epochs=2, shuffle=False,
                              verbose=0)
    scope = strategy.scope() if strategy else contextlib.nullcontext()
    with scope:
        model = build(AccumulatingModel, n_gradients=4)
        model.compile(optimizer=make_optimizer(), loss=loss)
    model.set_weights(build(keras.Model).get_weights())
    history = model.fit(x, y, sample_weight=sample_weight, batch_size=8,
                        epochs=2, shuffle=False, verbose=0)
    assert max_weight_difference(plain, model) <= TOLERANCE
    return plain_history.history["loss"], history.history["loss"]


def _masked_gru(model_class, **kwargs):
    keras.utils.set_random_seed(4)
    tokens = keras.Input((None,), dtype="int32")
    embedded = keras.layers.Embedding(VOCABULARY, 4, mask_zero=True)(tokens)
    hidden = keras.layers.GRU(6, return_sequences=True)(embedded)
    outputs = keras.layers.Dense(VOCABULARY)(hidden)
    return model_class(inputs=tokens, outputs=outputs, **kwargs)


def test_epoch_loss_of_masked_sequences_is_the_large_batch_loss():
    # Micro-batches of 2 and of 10 valid steps: weighting their losses by
    # samples, as Keras weights a batch, is not the large batch's loss.
    # SGD: Keras's Adam treats an Embedding's repeated rows one by one in
    # the large batch, which is not the reference (see test_exactness.py).
    _, y = _token_data()
    x = y.copy()
    plain, ours = _fit_histories(
        _masked_gru,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True), x, y,
        make_optimizer=lambda: keras.optimizers.SGD(0.1))
    np.testing.assert_allclose(ours, plain, rtol=1e-5)


@pytest.mark.parametrize("replicas", [1, 2])
def test_epoch_loss_with_ignored_tokens_is_the_large_batch_loss(
        replicas, two_replicas):
    x, y = _token_data()
    plain, ours = _fit_histories(
        _tagger,
        keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                   ignore_class=0),
        x, y, strategy=two_replicas if replicas == 2 else None)
    np.testing.assert_allclose(ours, plain, rtol=1e-5)


def test_epoch_loss_of_a_weighted_mean_is_the_large_batch_loss():
    x, y = regression_data(samples=64)
    weights = np.where(np.arange(64) % 16 < 8, 0.1, 3.0).astype("float32")
    try:
        loss = keras.losses.MeanSquaredError(
            reduction="mean_with_sample_weight")
    except ValueError:
        pytest.skip("this Keras has no reduction='mean_with_sample_weight'")
    plain, ours = _fit_histories(mlp, loss, x, y, sample_weight=weights)
    np.testing.assert_allclose(ours, plain, rtol=1e-5)


def _each_padded_to_its_longest(batches_of, xs, ys):
    """(x, y, padding mask) of each batch of `batches_of`, padded to its
    own longest sequence."""
    for indices in batches_of:
        longest = max(len(xs[i]) for i in indices)
        x = np.zeros((len(indices), longest, 3), "float32")
        y = np.zeros((len(indices), longest, 1), "float32")
        mask = np.zeros((len(indices), longest), "float32")
        for row, i in enumerate(indices):
            x[row, :len(xs[i])] = xs[i]
            y[row, :len(ys[i]), 0] = ys[i]
            mask[row, :len(xs[i])] = 1.0
        yield x, y, mask


@pytest.mark.parametrize("reduction", ["sum_over_batch_size",
                                       "mean_with_sample_weight"])
def test_micro_batches_padded_to_their_own_longest(reduction):
    # A loss over every position (padding weighted 0 but counted) divides
    # each micro-batch by its own padded length, the large batch by its
    # own: fit() says so and names the token mean, which is exact.
    rng = np.random.default_rng(3)
    lengths = rng.integers(2, 13, size=32)
    xs = [rng.normal(size=(n, 3)).astype("float32") for n in lengths]
    ys = [np.tanh(s.sum(axis=1)).astype("float32") for s in xs]
    micro = [list(range(i, i + 4)) for i in range(0, 32, 4)]
    try:
        loss = keras.losses.MeanSquaredError(reduction=reduction)
    except ValueError:
        pytest.skip(f"this Keras has no reduction={reduction!r}")

    def sequence_model(model_class, **kwargs):
        keras.utils.set_random_seed(5)
        inputs = keras.Input((None, 3))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = model_class(inputs=inputs,
                            outputs=keras.layers.Dense(1)(hidden), **kwargs)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        return model

    plain = sequence_model(keras.Model)
    for batch in _each_padded_to_its_longest(
            [sum(micro[i:i + 4], []) for i in (0, 4)], xs, ys):
        plain.train_on_batch(*batch)
    model = sequence_model(AccumulatingModel, n_gradients=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(_each_padded_to_its_longest(micro, xs, ys), epochs=1,
                  verbose=0)
    named = [str(w.message) for w in caught
             if "padded" in str(w.message)]
    assert iterations(model) == 2
    exact = max_weight_difference(plain, model) <= TOLERANCE
    assert exact == (reduction == "mean_with_sample_weight")
    assert len(named) == (0 if exact else 1)
    if named:
        assert "mean_with_sample_weight" in named[0]
