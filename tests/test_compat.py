"""The stacks accum_model admits, and a clear refusal of the others.

Run in the Keras 3 environment; `test_keras2.py` runs under Keras 2.
"""

import os
import subprocess
import sys

import keras
import pytest

from accum_model import _stack

_IMPORT = "import accum_model"


def _refusal_of_this_process():
    """The message of the ImportError the stack check raises here."""
    with pytest.raises(ImportError) as refusal:
        _stack.check_stack()
    return str(refusal.value)


def _import_with(env_changes, prelude="", postlude=""):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env_changes}
    return subprocess.run(
        [sys.executable, "-c", prelude + _IMPORT + postlude], env=env,
        capture_output=True, text=True, timeout=300,
    )


def test_legacy_keras_flag_gives_a_keras_2_model():
    pytest.importorskip("tf_keras")
    check = (
        "\nimport tensorflow as tf, tf_keras"
        "\nassert issubclass(accum_model.AccumulatingModel, tf.keras.Model)"
        "\nassert tf.keras.Model is tf_keras.Model"
    )
    result = _import_with({"TF_USE_LEGACY_KERAS": "1"}, postlude=check)
    assert result.returncode == 0, result.stderr[-2000:]


def test_legacy_keras_flag_without_tf_keras_names_the_fix(monkeypatch):
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # not installed
    message = _refusal_of_this_process()
    assert ("pip install 'tf-keras~=" in message
            or "pip install tensorflow tf-keras" in message)
    assert "unset TF_USE_LEGACY_KERAS" in message


def test_unsupported_backend_is_refused_naming_the_supported(monkeypatch):
    # Keras's "numpy" backend cannot train.
    monkeypatch.setattr(keras.backend, "backend", lambda: "numpy")
    message = _refusal_of_this_process()
    assert "found 'numpy'" in message
    assert "'tensorflow', 'jax'" in message
    assert "KERAS_BACKEND=tensorflow" in message


def test_keras_below_the_floor_is_refused_at_import():
    # In a process of its own: the refusal comes as accum_model is imported.
    prelude = "import keras\nkeras.__version__ = '3.5.0'\n"
    result = _import_with({}, prelude)
    assert result.returncode != 0
    assert "found keras 3.5.0" in result.stderr
    assert "pip install 'keras>=3.6'" in result.stderr


def test_keras_2_below_the_floor_is_refused(monkeypatch):
    monkeypatch.setattr(keras, "__version__", "2.12.0")
    message = _refusal_of_this_process()
    assert "found keras 2.12.0" in message
    assert "pip install 'tensorflow>=2.13,<2.16'" in message
