"""What differs by Keras backend: each one's refusals, by name, before
training.

The promise's tests themselves (exactness, losses, epochs, end of data,
window controls, contract, serialization) run on every backend: CI runs
them again under `KERAS_BACKEND=jax` and `KERAS_BACKEND=torch`, each in an
environment without TensorFlow. Here: what a backend does not carry is
refused with the argument to change, and nothing of TensorFlow is imported
on JAX or PyTorch. (The open window in saved files is tested by
`test_resume.py`, on every backend.)
"""

import os
import subprocess
import sys

import keras
import numpy as np
import pytest

from accum_model import AccumulatingModel
from backends import BACKEND
from helpers import batch_norm_mlp
from helpers import harness
from helpers import iterations
from helpers import mlp
from helpers import regression_data

jax_only = pytest.mark.skipif(BACKEND != "jax", reason="JAX backend only")
torch_only = pytest.mark.skipif(BACKEND != "torch",
                                reason="PyTorch backend only")


@torch_only
def test_importing_on_torch_imports_no_tensorflow_or_jax():
    code = ("import sys, accum_model, keras\n"
            "assert keras.backend.backend() == 'torch'\n"
            "print(sorted(m for m in sys.modules if m.startswith("
            "('tensorflow', 'tf_keras', 'jax'))))")
    result = subprocess.run([sys.executable, "-c", code],
                            env={**os.environ, "KERAS_BACKEND": "torch"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


@torch_only
def test_several_torch_processes_are_refused_before_training(monkeypatch):
    # Keras 3's fit() on PyTorch has no data parallelism: a window per
    # process would be applied apart, so a distributed run is refused.
    import torch

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    x, y = regression_data(samples=16)
    model = mlp(AccumulatingModel, n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    weights = model.get_weights()
    with pytest.raises(ValueError, match="one process"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert iterations(model) == 0
    assert all((a == b).all() for a, b in zip(weights, model.get_weights()))


def _torch_operations_per_window(model, x, y):
    """The aten operations 8 `train_on_batch` calls dispatch, after 8 that
    build and warm up."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.count += 1
            return func(*args, **(kwargs or {}))

    batch = len(x) // 16
    for start in range(0, 8 * batch, batch):
        model.train_on_batch(x[start:start + batch], y[start:start + batch])
    with Counting():
        for start in range(8 * batch, 16 * batch, batch):
            model.train_on_batch(x[start:start + batch],
                                 y[start:start + batch])
    return Counting.count


def _deep_mlp(model_class, layers, width, optimizer, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    hidden = inputs
    for _ in range(layers):
        hidden = keras.layers.Dense(width, activation="relu")(hidden)
    model = model_class(inputs, keras.layers.Dense(1)(hidden), **kwargs)
    model.compile(optimizer=optimizer, loss="mse")
    return model


@torch_only
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_torch_micro_step_costs_no_operation_per_variable(optimizer):
    # The window's sums live in `.grad`, which backward() adds into: what
    # a window of 8 micro steps dispatches beyond 8 steps of plain Keras
    # does not grow with the model's variables (adding to a sum per
    # variable would cost 8 operations per variable here).
    extra = {}
    for layers in (4, 16):
        x, y = regression_data(samples=128, features=16, outputs=1)
        plain = _deep_mlp(keras.Model, layers, 16, optimizer)
        accumulating = _deep_mlp(AccumulatingModel, layers, 16, optimizer,
                                 n_gradients=8)
        extra[layers] = (_torch_operations_per_window(accumulating, x, y)
                         - _torch_operations_per_window(plain, x, y))
        assert iterations(accumulating) == 2
    added_variables = 2 * (16 - 4)
    assert extra[16] - extra[4] <= added_variables, extra


def _conv_bn(model_class, blocks, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    hidden = inputs
    for _ in range(blocks):
        hidden = keras.layers.Conv2D(4, 3, padding="same")(hidden)
        hidden = keras.layers.ReLU()(keras.layers.BatchNormalization()(hidden))
    outputs = keras.layers.Dense(1)(keras.layers.GlobalAveragePooling2D()(
        hidden))
    model = model_class(inputs, outputs, **kwargs)
    model.compile(optimizer="adam", loss="mse")
    return model


@torch_only
def test_torch_pools_batch_normalization_in_few_operations_per_layer():
    # Each micro step adds every layer's moments to the window's sums in a
    # few operations for all layers together; what a layer costs is its
    # move once per window (recording, putting back and adding per layer
    # and micro step cost about 20 operations each).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8, 8, 3)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    extra = {}
    for blocks in (2, 8):
        plain = _conv_bn(keras.Model, blocks)
        accumulating = _conv_bn(AccumulatingModel, blocks, n_gradients=8)
        extra[blocks] = (_torch_operations_per_window(accumulating, x, y)
                         - _torch_operations_per_window(plain, x, y))
        assert iterations(accumulating) == 2
    added_layers = 8 - 2
    assert extra[8] - extra[2] <= added_layers * 8 * 5, extra


@torch_only
def test_gradients_cleared_in_an_open_window_are_refused_on_torch():
    # The open window's sums are the weights' `.grad`: clearing them
    # between micro steps must not pass as a smaller window.
    x, y = regression_data(samples=32)
    model = mlp(AccumulatingModel, n_gradients=4)
    model.compile(optimizer="sgd", loss="mse")
    model.train_on_batch(x[:8], y[:8])
    model.zero_grad()
    with pytest.raises(RuntimeError, match="apply_open_window"):
        model.train_on_batch(x[8:16], y[8:16])
    assert iterations(model) == 0


@torch_only
def test_a_torch_micro_step_dispatches_at_most_5_percent_over_plain_keras():
    # The 20-layer MLP of benchmarks/torch_operations.py, under Adam.
    x, y = regression_data(samples=512, features=64, outputs=1)
    plain = _deep_mlp(keras.Model, 20, 64, "adam")
    accumulating = _deep_mlp(AccumulatingModel, 20, 64, "adam",
                             n_gradients=8)
    counts = (_torch_operations_per_window(plain, x, y),
              _torch_operations_per_window(accumulating, x, y))
    assert counts[1] <= 1.05 * counts[0], counts


@jax_only
def test_importing_on_jax_imports_no_tensorflow():
    code = ("import sys, accum_model, keras\n"
            "assert keras.backend.backend() == 'jax'\n"
            "print(sorted(m for m in sys.modules if m.startswith("
            "('tensorflow', 'tf_keras'))))")
    result = subprocess.run([sys.executable, "-c", code],
                            env={**os.environ, "KERAS_BACKEND": "jax"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"


@jax_only
def test_a_distribution_of_ones_own_is_refused_by_name():
    # DataParallel and ModelParallel are tested in test_distribution.py.
    from keras.src.distribution.distribution_lib import Distribution

    class OwnDistribution(Distribution):
        def get_data_layout(self, data_shape):
            raise AssertionError("never reached")

        get_variable_layout = get_tensor_layout = get_data_layout
        distribute_dataset = get_data_layout

    x, y = regression_data(samples=16)
    model = mlp(AccumulatingModel, n_gradients=2)
    model.compile(optimizer="sgd", loss="mse")
    keras.distribution.set_distribution(
        OwnDistribution(keras.distribution.DeviceMesh(
            (1,), ["batch"], devices=keras.distribution.list_devices()[:1])))
    try:
        with pytest.raises(ValueError,
                           match="OwnDistribution is not supported"):
            model.fit(x, y, batch_size=8, verbose=0)
    finally:
        keras.distribution.set_distribution(None)
    assert iterations(model) == 0


@jax_only
@pytest.mark.parametrize("settings, name", [
    ({"accumulator_dtype": "float64"}, "jax_enable_x64"),
])
def test_settings_jax_cannot_carry_are_refused_at_construction(settings,
                                                               name):
    with pytest.raises(ValueError, match=name):
        mlp(AccumulatingModel, n_gradients=2, **settings)


def _jax_step_memory(model, x, y):
    """Bytes the compiled training step holds: its arguments, the donated
    state among them, and its temporaries."""
    analysis = harness.jax_step_memory(model, x, y)
    return analysis.argument_size_in_bytes + analysis.temp_size_in_bytes


@jax_only
@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_the_compiled_jax_step_holds_one_copy_of_the_weights_beyond_plain(
        policy):
    # The window's sums are the one copy; emptying them in the window end's
    # conditional held every sum a second time.
    x, y = regression_data(samples=32, features=256, outputs=1)
    keras.mixed_precision.set_global_policy(policy)
    try:
        plain = _deep_mlp(keras.Model, 6, 256, "adam")
        accumulating = _deep_mlp(AccumulatingModel, 6, 256, "adam",
                                 n_gradients=4)
        weight_bytes = 4 * sum(int(np.prod(v.shape))
                               for v in plain.trainable_variables)
        beyond = (_jax_step_memory(accumulating, x, y)
                  - _jax_step_memory(plain, x, y))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert beyond <= 1.05 * weight_bytes, beyond / weight_bytes


def _trained(selects_outcomes, policy, accumulator_dtype, x, y):
    # conftest's float32_policy puts the policy back after the test.
    keras.mixed_precision.set_global_policy(policy)
    model = batch_norm_mlp(AccumulatingModel, n_gradients=4,
                           measure_noise_scale=True,
                           accumulator_dtype=accumulator_dtype)
    model._accumulation.selects_outcomes = selects_outcomes
    model.compile(optimizer=keras.optimizers.Adam(1e-2, clipnorm=1.0),
                  loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False,
                        verbose=0)
    hlo = harness.jax_compiled_step(model, x[:8], y[:8]).as_text()
    return model, hlo, history.history["noise_scale"]


@jax_only
@pytest.mark.filterwarnings("ignore:BatchNormalization layers")
@pytest.mark.parametrize("policy, accumulator_dtype, overflows", [
    ("float32", "float32", False), ("mixed_bfloat16", "float32", False),
    ("float32", "float16", True), ("mixed_float16", "float32", True)])
def test_a_window_end_selected_rather_than_branched_trains_alike(
        policy, accumulator_dtype, overflows):
    # On a GPU the step computes the window's end and keeps it only where
    # the window ends (a conditional there stops the host); elsewhere it
    # branches. Pooled statistics, the noise scale, clipping and a window
    # that overflows come out the same either way. Under loss scaling
    # Keras's optimizer branches itself, and the window's end with it.
    x, y = regression_data(samples=64)
    if overflows:
        y[41] = 1e6
    branched, branched_hlo, branched_noise = _trained(
        False, policy, accumulator_dtype, x, y)
    selected, selected_hlo, selected_noise = _trained(
        True, policy, accumulator_dtype, x, y)
    assert " conditional(" in branched_hlo
    assert (" conditional(" in selected_hlo) == (policy == "mixed_float16")
    assert iterations(selected) == iterations(branched) > 0
    assert selected.skipped_windows == branched.skipped_windows == (
        2 if overflows else 0)
    for a, b in zip(selected.get_weights(), branched.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(selected_noise, branched_noise, rtol=1e-5)
