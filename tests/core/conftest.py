"""The core's own tests: the window's state and transitions on NumPy, with
no Keras and no backend imported (`python -m pytest tests/core` runs in
seconds)."""

import pathlib
import sys
import types

import pytest

CORE_TESTS = pathlib.Path(__file__).resolve().parent


def pytest_configure(config):
    """Run alone, these tests stand a bare package in for `accum_model`,
    so that `accum_model.core` is all they import: the package's
    `__init__` chooses a Keras adapter (and so imports Keras). Run with the
    rest of the suite, they import the real package."""
    paths = [pathlib.Path(str(arg).split("::")[0]).resolve()
             for arg in config.args]
    alone = paths and all(path == CORE_TESTS or CORE_TESTS in path.parents
                          for path in paths)
    if alone and "accum_model" not in sys.modules:
        package = types.ModuleType("accum_model")
        package.__path__ = [str(CORE_TESTS.parents[1] / "accum_model")]
        sys.modules["accum_model"] = package


@pytest.fixture(autouse=True)
def float32_policy():
    """Stands in for the suite's fixture of that name: no Keras here."""
    yield


@pytest.fixture(autouse=True, scope="session")
def no_keras_imported(request):
    """Fails the run if these tests, run alone, imported Keras or a
    backend."""
    yield
    if all("tests/core" in str(item.fspath)
           for item in request.session.items):
        imported = [name for name in ("keras", "tensorflow", "jax", "torch")
                    if name in sys.modules]
        assert not imported, f"the core's tests imported {imported}"
