"""The stacks accum_model admits, and a clear refusal of the others."""

import os
import subprocess
import sys

import pytest

_IMPORT = "import accum_model"


def _import_with(env_changes, prelude=""):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env_changes}
    return subprocess.run(
        [sys.executable, "-c", prelude + _IMPORT], env=env,
        capture_output=True, text=True, timeout=300,
    )


def test_legacy_keras_flag_is_refused_at_import():
    result = _import_with({"TF_USE_LEGACY_KERAS": "1"})
    assert result.returncode != 0
    assert "TF_USE_LEGACY_KERAS" in result.stderr
    assert "unset TF_USE_LEGACY_KERAS" in result.stderr


def test_other_backend_is_refused_at_import():
    pytest.importorskip("jax")
    result = _import_with({"KERAS_BACKEND": "jax"})
    assert result.returncode != 0
    assert "KERAS_BACKEND=tensorflow" in result.stderr


def test_keras_below_the_floor_is_refused_at_import():
    prelude = "import keras\nkeras.__version__ = '3.5.0'\n"
    result = _import_with({}, prelude)
    assert result.returncode != 0
    assert "found keras 3.5.0" in result.stderr
    assert "pip install 'keras>=3.6'" in result.stderr


def test_keras_2_is_refused_at_import():
    prelude = "import keras\nkeras.__version__ = '2.15.0'\n"
    result = _import_with({}, prelude)
    assert result.returncode != 0
    assert "Keras 2" in result.stderr


def test_this_stack_imports():
    result = _import_with({})
    assert result.returncode == 0, result.stderr[-2000:]
