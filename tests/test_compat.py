"""The stacks accum_model admits, and a clear refusal of the others.

Run in the Keras 3 environment; `test_keras2.py` runs under Keras 2.
"""

import os
import subprocess
import sys

import pytest

_IMPORT = "import accum_model"


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


def test_legacy_keras_flag_without_tf_keras_names_the_fix():
    prelude = "import sys\nsys.modules['tf_keras'] = None\n"
    result = _import_with({"TF_USE_LEGACY_KERAS": "1"}, prelude)
    assert result.returncode != 0
    assert "pip install 'tf-keras~=" in result.stderr or (
        "pip install tensorflow tf-keras" in result.stderr)
    assert "unset TF_USE_LEGACY_KERAS" in result.stderr


def test_unsupported_backend_is_refused_at_import_naming_the_supported():
    # Keras's "numpy" backend cannot train.
    prelude = "import keras\nkeras.backend.backend = lambda: 'numpy'\n"
    result = _import_with({}, prelude)
    assert result.returncode != 0
    assert "found 'numpy'" in result.stderr
    assert "'tensorflow', 'jax'" in result.stderr
    assert "KERAS_BACKEND=tensorflow" in result.stderr


def test_keras_below_the_floor_is_refused_at_import():
    prelude = "import keras\nkeras.__version__ = '3.5.0'\n"
    result = _import_with({}, prelude)
    assert result.returncode != 0
    assert "found keras 3.5.0" in result.stderr
    assert "pip install 'keras>=3.6'" in result.stderr


def test_keras_2_below_the_floor_is_refused_at_import():
    prelude = "import keras\nkeras.__version__ = '2.12.0'\n"
    result = _import_with({}, prelude)
    assert result.returncode != 0
    assert "found keras 2.12.0" in result.stderr
    assert "pip install 'tensorflow>=2.13,<2.16'" in result.stderr


def test_this_stack_imports():
    result = _import_with({})
    assert result.returncode == 0, result.stderr[-2000:]
