"""Paths that leave the large batch say so at `fit()`, once, and exact paths
stay quiet: a BatchNormalization that trains, layers that add losses, and a
window that `train_on_batch` left open."""

import warnings

import numpy as np
import pytest

from accum_model import AccumulatingModel
from accum_model import _checks
from accum_model import accumulating
from accum_model._chooser import adapter
from backends import ON_TORCH
from backends import keras_2_too
from helpers import AfterMicroBatch
from helpers import fit_both
from helpers import iterations
from helpers import keras
from helpers import max_weight_difference
from helpers import mean_of_squares
from helpers import mlp
from helpers import regression_data
from helpers import sum_of_squares
from helpers import weights_file

pytestmark = keras_2_too


def _conv_bn(model_class=AccumulatingModel, frozen=False, **kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.Conv2D(4, 3)(inputs)
    norm = keras.layers.BatchNormalization(name="norm")
    norm.trainable = not frozen
    hidden = keras.layers.GlobalAveragePooling2D()(norm(hidden))
    outputs = keras.layers.Dense(1)(hidden)
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def _images(samples=16):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(samples, 6, 6, 2)).astype("float32"),
            rng.normal(size=(samples, 1)).astype("float32"))


def _fit_messages(model, x, y, **fit_kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, **fit_kwargs)
    return [str(w.message) for w in caught
            if issubclass(w.category, UserWarning)]


def test_training_batch_normalization_is_named_with_the_choices():
    x, y = _images()
    model = _conv_bn(n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    messages = [m for m in _fit_messages(model, x, y)
                if "BatchNormalization" in m]
    assert len(messages) == 1
    assert "['norm']" in messages[0]
    for choice in ("trainable = False", "GroupNormalization",
                   "LayerNormalization"):
        assert choice in messages[0]
    # Once per model: a second fit() is quiet.
    assert not [m for m in _fit_messages(model, x, y)
                if "BatchNormalization" in m]


def test_the_warning_says_what_the_window_makes_exact():
    x, y = _images()
    model = _conv_bn(n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    [message] = [m for m in _fit_messages(model, x, y)
                 if "BatchNormalization" in m]
    if adapter.pools_moving_statistics(model.get_layer("norm")):
        assert ("large batch's for a layer with no training "
                "BatchNormalization upstream") in message
        assert "gradients are not the large batch's" in message
    else:
        assert "once per micro-batch" in message


class _OwnCallNorm(keras.layers.BatchNormalization):
    """A subclass with a `call` of its own: it may move its statistics its
    own way, so the window leaves them to it."""

    def call(self, inputs, training=None, mask=None):
        return super().call(inputs, training=training, mask=mask)


def test_statistics_the_window_cannot_pool_are_named_apart():
    x, y = _images()
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6, 6, 2))
    hidden = keras.layers.Conv2D(4, 3)(inputs)
    hidden = _OwnCallNorm(name="own_call")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    model = AccumulatingModel(inputs, keras.layers.Dense(1)(hidden),
                              n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    [message] = [m for m in _fit_messages(model, x, y)
                 if "BatchNormalization" in m]
    assert "['own_call']" in message and "once per micro-batch" in message


def test_frozen_batch_normalization_is_quiet():
    x, y = _images()
    model = _conv_bn(n_gradients=2, frozen=True)
    model.compile(optimizer="sgd", loss="mse")
    assert not [m for m in _fit_messages(model, x, y)
                if "BatchNormalization" in m]


def test_batch_normalization_of_an_existing_model_is_named():
    x, y = _images()
    model = accumulating(_conv_bn(keras.Model), n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    assert [m for m in _fit_messages(model, x, y) if "BatchNormalization" in m]


@pytest.mark.skipif(keras.backend.backend() != "torch",
                    reason="PyTorch backend only: a torch module in Keras")
def test_torch_batch_normalization_in_a_wrapper_is_named():
    import torch

    x, _ = regression_data(samples=16)
    y = x[:, :1]
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    wrapped = keras.layers.TorchModuleWrapper(torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8)), name="torch_block",
        output_shape=(None, 8))
    model = AccumulatingModel(inputs, keras.layers.Dense(1)(wrapped(inputs)),
                              n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    messages = [m for m in _fit_messages(model, x, y)
                if "running batch statistics" in m]
    assert len(messages) == 1 and "torch_block.1" in messages[0]
    # Without normalisation nothing is said.
    plain_block = keras.layers.TorchModuleWrapper(torch.nn.Linear(6, 8),
                                                 output_shape=(None, 8))
    quiet = AccumulatingModel(inputs, keras.layers.Dense(1)(
        plain_block(inputs)), n_gradients=2)
    quiet.compile(optimizer="sgd", loss="mse")
    assert not [m for m in _fit_messages(quiet, x, y)
                if "running batch statistics" in m]


def test_without_accumulation_nothing_is_said():
    x, y = _images()
    model = _conv_bn(n_gradients=1)
    model.compile(optimizer="sgd", loss="mse")
    assert not [m for m in _fit_messages(model, x, y)
                if "BatchNormalization" in m]


class _SummedPenalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(0.01 * sum_of_squares(inputs))
        return inputs


def _with_layer(layer, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, **kwargs)(inputs)
    outputs = keras.layers.Dense(3)(layer(hidden) if layer else hidden)
    return AccumulatingModel(inputs=inputs, outputs=outputs, n_gradients=2)


def _fit_messages_with(layer, about):
    """The warnings that mention `about` in a fit() of `_with_layer`."""
    x, y = regression_data(samples=16)
    model = _with_layer(layer)
    model.compile(optimizer="sgd", loss="mse")
    return [m for m in _fit_messages(model, x, y) if about in m]


class _SummedPenaltyByMethod(keras.layers.Layer):
    def call(self, inputs):
        self._penalize(inputs)
        return inputs

    def _penalize(self, inputs):
        self.add_loss(0.01 * sum_of_squares(inputs))


@pytest.mark.parametrize("layer_class", [_SummedPenalty,
                                         _SummedPenaltyByMethod])
def test_layers_that_add_losses_are_named_with_the_fix(layer_class):
    messages = _fit_messages_with(layer_class(name="penalty"), "add_loss")
    assert len(messages) == 1
    assert "['penalty']" in messages[0]
    assert "divide such a term by the batch size" in messages[0]


class _MeanPenalty(keras.layers.Layer):
    def call(self, inputs):
        self.add_loss(0.1 * mean_of_squares(inputs))
        return inputs


class _CountedPenalty(keras.layers.Layer):
    """Counts its training calls in a variable, and adds a mean then."""

    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros",
                                     trainable=False, name="calls")

    def call(self, inputs, training=False):
        if training:
            self.calls.assign_add(1.0)
            self.add_loss(0.1 * mean_of_squares(inputs))
        return inputs


def test_trying_a_layer_that_adds_losses_leaves_it_as_it_was():
    inputs = keras.Input((6,))
    layer = _CountedPenalty()
    keras.Model(inputs, layer(keras.layers.Dense(8)(inputs)))
    assert _checks._added_loss_growth(layer) == "mean"
    assert _checks._added_loss_growth(_SummedPenalty()) is None
    assert float(np.array(layer.calls)) == 0.0


def _fit_both_with(layer_class):
    """Plain Keras's large batch and the window, each with a `layer_class`
    layer named "penalty" between two Dense layers; and the warnings."""
    x, y = regression_data(samples=32)

    def build(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = layer_class(name="penalty")(
            keras.layers.Dense(8, activation="tanh")(inputs))
        return model_class(inputs=inputs,
                           outputs=keras.layers.Dense(3)(hidden), **kwargs)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain, model = fit_both(build, lambda: keras.optimizers.SGD(0.5), x,
                                y, micro_batch=4, n_gradients=4)
    return plain, model, [str(w.message) for w in caught]


def test_a_mean_added_with_add_loss_is_exact_and_quiet():
    plain, model, messages = _fit_both_with(_MeanPenalty)
    assert not [m for m in messages if "add_loss" in m]
    assert max_weight_difference(plain, model) <= 1e-6


class _RunningMean(keras.layers.Layer):
    def build(self, input_shape):
        self.mean = self.add_weight(shape=(input_shape[-1],),
                                    initializer="zeros", trainable=False)

    def call(self, inputs, training=False):
        if training:
            # Moved by the batch's first sample (either Keras's ops).
            self.mean.assign(0.9 * self.mean + 0.1 * inputs[0])
        return inputs - self.mean


class _RunningMeanByMethod(_RunningMean):
    def call(self, inputs, training=False):
        if training:
            self._move(inputs)
        return inputs - self.mean

    def _move(self, inputs):
        self.mean.assign(0.9 * self.mean + 0.1 * inputs[0])


@pytest.mark.parametrize("layer_class", [_RunningMean,
                                         _RunningMeanByMethod])
def test_layers_that_write_variables_are_named(layer_class):
    # The running mean moves once per micro-batch, not once per large
    # batch: the window cannot be the large batch, and fit() says so,
    # whether `call` writes it or a method `call` reaches.
    messages = _fit_messages_with(layer_class(name="running"), "`call`")
    assert len(messages) == 1
    assert "['running']" in messages[0]
    assert "once per micro-batch" in messages[0]
    # Keras's own layers (none writes a variable in `call` but
    # BatchNormalization, named apart) are quiet.
    assert not _fit_messages_with(None, "`call`")


@pytest.mark.skipif(ON_TORCH, reason=(
    "plain Keras on PyTorch cannot train a stateful LSTM (keras 3.15.1, "
    "torch 2.13: an in-place autograd error)"))
@pytest.mark.parametrize("stateful", [True, False])
def test_stateful_recurrent_layers_are_named(stateful):
    # A stateful LSTM carries its state from micro-batch to micro-batch,
    # the large batch's from large batch to large batch.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 5, 3)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    inputs = keras.Input((5, 3), batch_size=4)
    hidden = keras.layers.LSTM(4, stateful=stateful, name="memory")(inputs)
    model = AccumulatingModel(inputs=inputs,
                              outputs=keras.layers.Dense(2)(hidden),
                              n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    messages = [m for m in _fit_messages(model, x, y) if "stateful" in m]
    assert len(messages) == int(stateful)
    if stateful:
        assert "['memory']" in messages[0]
        assert "stateful=False" in messages[0]


def test_keras_regularizers_are_quiet():
    x, y = regression_data(samples=16)
    model = _with_layer(None, kernel_regularizer="l2",
                        activity_regularizer="l1")
    model.compile(optimizer="sgd", loss="mse")
    assert not [m for m in _fit_messages(model, x, y) if "add_loss" in m]


def test_a_window_left_open_by_train_on_batch_is_named():
    x, y = regression_data(samples=16)
    model = _with_layer(None)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x[:4], y[:4])
    messages = [m for m in _fit_messages(model, x, y)
                if "left open" in m]
    assert len(messages) == 1
    assert "(1 micro-batch accumulated)" in messages[0]
    assert "apply_open_window()" in messages[0]


def test_fit_after_applying_the_open_window_is_quiet():
    x, y = regression_data(samples=16)
    model = _with_layer(None)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x[:4], y[:4])
    model.apply_open_window()
    assert not [m for m in _fit_messages(model, x, y) if "left open" in m]


def test_a_window_restored_from_a_checkpoint_is_continued_quietly(tmp_path):
    x, y = regression_data(samples=16)
    model = _with_layer(None)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x[:4], y[:4])
    path = weights_file(tmp_path, "mid_window")
    model.save_weights(path)
    resumed = _with_layer(None)
    resumed.compile(optimizer="sgd", loss="mse")
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(path)
    assert resumed._accumulation.open_micro_steps() == 1
    assert not [m for m in _fit_messages(resumed, x, y) if "left open" in m]


def _stacked_bn(count):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((4,))
    hidden = inputs
    for index in range(count):
        hidden = keras.layers.BatchNormalization(name=f"bn_{index}")(
            keras.layers.Dense(4)(hidden))
    return AccumulatingModel(inputs, keras.layers.Dense(1)(hidden),
                             n_gradients=2)


def test_a_warning_points_at_the_users_fit_line():
    x, y = regression_data(samples=16, features=4, outputs=1)
    model = _stacked_bn(1)
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, verbose=0)
    told = [w for w in caught if "BatchNormalization" in str(w.message)]
    assert told
    assert {w.filename for w in told} == {__file__}


def test_many_layers_are_named_by_count_and_a_few():
    x, y = regression_data(samples=16, features=4, outputs=1)
    model = _stacked_bn(6)
    model.compile(optimizer="sgd", loss="mse")
    told = [m for m in _fit_messages(model, x, y)
            if "BatchNormalization layers" in m]
    assert len(told) == 1
    assert "6 (bn_0, bn_1, bn_2, ...;" in told[0]
    assert "bn_5" not in told[0]
    assert "_flatten_layers()" in told[0]


# Activity regularizers of one's own, in either Keras's ops.
_ops = getattr(keras, "ops", None) or keras.backend


def _mean_penalty(activations):
    return 0.5 * _ops.mean(_ops.square(activations))


def _summed_penalty(activations):
    return 0.05 * _ops.sum(_ops.square(activations))


def _sparsity_penalty(activations, target=0.1):
    """KL divergence of a target from the batch's mean activation."""
    mean = _ops.mean(activations, axis=0)
    return _ops.sum(target * _ops.log(target / mean) + (1 - target)
                    * _ops.log((1 - target) / (1 - mean)))


def _sigmoid_regularized(regularizer):
    def build(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(8, activation="sigmoid",
                                    activity_regularizer=regularizer,
                                    name="hidden")(inputs)
        return model_class(inputs=inputs,
                           outputs=keras.layers.Dense(3)(hidden), **kwargs)
    return build


@pytest.mark.parametrize("regularizer", [
    _mean_penalty, _sparsity_penalty, _summed_penalty, "l2"])
def test_activity_regularizers_are_named_where_they_leave_the_large_batch(
        regularizer):
    # Keras 2 and keras 3.14+ divide an activity penalty by the batch size:
    # a sum of per-sample penalties is exact, a mean or a penalty on the
    # batch's mean is not. keras 3.6-3.13 add it as it is: a mean is exact,
    # a sum (Keras's own "l2") is not. fit() says which.
    divided = adapter.losses.activity_penalty_is_a_mean()
    x, y = regression_data(samples=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain, model = fit_both(_sigmoid_regularized(regularizer),
                                lambda: keras.optimizers.SGD(0.5), x, y,
                                micro_batch=4, n_gradients=4)
    named = [str(w.message) for w in caught
             if "activity regularizer" in str(w.message)]
    exact = max_weight_difference(plain, model) <= 1e-6
    assert len(named) == (0 if exact else 1)
    assert exact == (regularizer in ((_summed_penalty, "l2") if divided
                                     else (_mean_penalty,)))
    if named:
        assert "['hidden']" in named[0]
        assert ("pip install 'keras>=3.14'" in named[0]) == (not divided)


def test_activity_penalty_beside_a_summed_loss_is_named_where_inexact():
    # A window of a loss reduced with "sum" adds its micro-batches up: an
    # L2 penalty added undivided (keras 3.6-3.13) adds up to the large
    # batch's, one divided by the batch size does not, and the loss's
    # warning names the other losses there. (Where it is exact, the loss's
    # warning still speaks of other losses, as of a kernel regularizer's.)
    divided = adapter.losses.activity_penalty_is_a_mean()
    x, y = regression_data(samples=32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain, model = fit_both(
            _sigmoid_regularized("l2"), lambda: keras.optimizers.SGD(0.01),
            x, y, micro_batch=4, n_gradients=4,
            loss=keras.losses.MeanSquaredError(reduction="sum"))
    messages = [str(w.message) for w in caught]
    exact = max_weight_difference(plain, model) <= 1e-6
    assert exact == (not divided)
    assert not [m for m in messages if "activity regularizer" in m]
    if divided:
        assert [m for m in messages if "adds other losses" in m]


@pytest.mark.parametrize("penalty", ["activity_regularizer", "add_loss"])
def test_a_penalty_per_sample_beside_a_loss_of_valid_elements_is_named(
        penalty):
    # `ignore_class` makes the loss a mean over the labels not ignored, the
    # weight of each micro-batch; an activity penalty, or a mean a layer
    # adds with `add_loss`, is per sample.
    x, _ = regression_data(samples=32)
    labels = (np.abs(x[:, 0] * 3).astype("int32") % 3)

    def build(model_class, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6,))
        if penalty == "add_loss":
            hidden = _MeanPenalty(name="hidden")(
                keras.layers.Dense(8, activation="tanh")(inputs))
        else:
            hidden = keras.layers.Dense(8, activation="tanh",
                                        activity_regularizer="l2",
                                        name="hidden")(inputs)
        return model_class(inputs=inputs,
                           outputs=keras.layers.Dense(3)(hidden), **kwargs)

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True,
                                                      ignore_class=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain, model = fit_both(build, lambda: keras.optimizers.SGD(0.5), x,
                                labels, micro_batch=4, n_gradients=4,
                                loss=loss)
    named = [str(w.message) for w in caught
             if "activity penalty" in str(w.message)
             and "valid elements" in str(w.message)]
    assert max_weight_difference(plain, model) > 1e-5
    assert len(named) == 1 and "['hidden']" in named[0]
    assert not [w for w in caught if "add losses with" in str(w.message)]


class _LoadBalancing(keras.layers.Layer):
    """A mixture of experts' load-balancing term: a product of the batch's
    mean routing probabilities and mean assignments."""

    def call(self, inputs):
        probabilities = _ops.softmax(inputs)
        shares = _ops.mean(probabilities, axis=0)
        assigned = _ops.mean(_ops.one_hot(_ops.argmax(inputs, axis=-1), 8),
                             axis=0)
        self.add_loss(8.0 * _ops.sum(shares * assigned))
        return inputs


@pytest.mark.skipif(not hasattr(keras, "ops"), reason="keras.ops")
def test_a_term_of_batch_statistics_is_named_as_beyond_any_weighting():
    plain, model, messages = _fit_both_with(_LoadBalancing)
    named = [m for m in messages if "add_loss" in m]
    assert max_weight_difference(plain, model) > 1e-4
    assert len(named) == 1 and "['penalty']" in named[0]
    assert "no weighting of the micro-batches" in named[0]


class _PairwiseSigmoid(keras.losses.Loss):
    """One number for the batch from every pair of its samples."""

    def call(self, y_true, y_pred):
        logits = _ops.matmul(y_pred, _ops.transpose(y_true))
        labels = 2.0 * _ops.eye(_ops.shape(logits)[0]) - 1.0
        return -_ops.mean(_ops.log_sigmoid(labels * logits))


@pytest.mark.skipif(not hasattr(keras, "ops"), reason="keras.ops")
def test_a_loss_over_pairs_of_the_batch_is_named_as_beyond_any_weight():
    x, y = regression_data(samples=16)
    model = _with_layer(None)
    model.compile(optimizer="sgd", loss=_PairwiseSigmoid())
    messages = [m for m in _fit_messages(model, x, y)
                if "one number for the whole" in m]
    assert len(messages) == 1
    assert "no weight reproduces it" in messages[0]


@pytest.mark.parametrize("n_gradients, flush_each_epoch, named", [
    (8, True, True), (4, True, False), (8, False, False)])
def test_an_epoch_shorter_than_a_window_is_named(n_gradients,
                                                 flush_each_epoch, named):
    x, y = regression_data(samples=16)
    model = mlp(AccumulatingModel, n_gradients=n_gradients,
                flush_each_epoch=flush_each_epoch)
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    cut = [str(w.message) for w in caught if "fewer than a window" in
           str(w.message)]
    assert len(cut) == named  # once, for both epochs
    if named:
        assert "n_gradients <= 4" in cut[0]
        assert "flush_each_epoch=False" in cut[0]
        # Each epoch's 4 micro-batches were one update, as it says.
        assert iterations(model) == 2


@pytest.mark.parametrize("samples, saved_after, epochs, named", [
    # Saved after 3 of 4 micro-batches; the resumed epoch's one micro-batch
    # ends that window. A second epoch of one micro-batch is cut.
    (16, 3, 1, False), (16, 3, 2, True),
    # Saved after 5 of 6 micro-batches (a window, then one of the last
    # window's two); the rest of the epoch ends that window where the
    # uninterrupted epoch ends it, short as the large batch's last batch.
    (24, 5, 1, False)])
def test_the_rest_of_an_epoch_after_a_restored_window_is_not_named(
        samples, saved_after, epochs, named, tmp_path):
    x, y = regression_data(samples=samples)
    file = weights_file(tmp_path, "mid")
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, callbacks=[
        AfterMicroBatch(saved_after, lambda m: m.save_weights(file))])
    resumed = mlp(AccumulatingModel, n_gradients=4)
    resumed.compile(optimizer="sgd", loss="mse")
    resumed.optimizer.build(resumed.trainable_variables)
    resumed.load_weights(file)
    assert resumed._accumulation.open_micro_steps() == saved_after % 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(x[4 * saved_after:], y[4 * saved_after:], batch_size=4,
                    epochs=epochs, verbose=0)
    cut = [str(w.message) for w in caught if "fewer than a window" in
           str(w.message)]
    assert len(cut) == named
    assert iterations(resumed) == saved_after // 4 + epochs


def test_a_model_that_loads_plain_says_so_when_saved(tmp_path):
    model = accumulating(keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(1)]), 2)
    model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.save(tmp_path / "model.keras")
    said = [str(w.message) for w in caught if "does not accumulate" in
            str(w.message)]
    assert len(said) == 1 and "accumulating(model, ...)" in said[0]
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert not isinstance(loaded, AccumulatingModel)  # as it said
