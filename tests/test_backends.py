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
import pytest

from accum_model import AccumulatingModel
from backends import BACKEND
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

