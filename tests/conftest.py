"""Shared test set-up: two logical CPU devices, quiet TensorFlow, clean policy."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from importlib import metadata  # noqa: E402

import pytest  # noqa: E402


def _version(distribution):
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


# TensorFlow distributions install the same `tensorflow` package, each
# overwriting the other's files: of one version that is harmless (tf-keras
# pulls in `tensorflow` next to a `tensorflow-cpu` of its version), of two
# versions the suite would test a mixture. Say so before importing it.
_TENSORFLOWS = {d: _version(d)
                for d in ("tensorflow", "tensorflow-cpu", "tensorflow-gpu")}
_TENSORFLOWS = {d: v for d, v in _TENSORFLOWS.items() if v is not None}
if len(set(_TENSORFLOWS.values())) > 1:
    raise pytest.UsageError(
        "This environment mixes TensorFlow distributions of different "
        "versions ("
        + ", ".join(f"{d}=={v}" for d, v in sorted(_TENSORFLOWS.items()))
        + "). Run the tests in a fresh virtual environment: python -m venv "
        "venv && . venv/bin/activate && python -m pip install -e \".[test]\" "
        "&& python -m pytest -n 2"
    )

# On JAX, two CPU devices for `keras.distribution` (read when JAX starts).
if os.environ.get("KERAS_BACKEND") == "jax" and (
        "xla_force_host_platform_device_count"
        not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=2")

# The core's own tests (tests/core) run without Keras or a backend.
CORE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "core")


def pytest_configure(config):
    """Sets up Keras's backend before any test module imports it, unless
    only the core's tests run."""
    paths = [os.path.abspath(str(arg).split("::")[0]) for arg in config.args]
    if paths and all(path.startswith(CORE) for path in paths):
        return
    from backends import ON_TENSORFLOW

    if ON_TENSORFLOW:
        import tensorflow as tf

        # Distribution tests need two replicas; the split must happen
        # before TensorFlow initialises its devices, so it is done once,
        # here.
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )


@pytest.fixture(autouse=True)
def float32_policy():
    """Every test starts and ends under the float32 policy (of `keras`, and
    of the Keras the model trains with where that is Keras 2)."""
    import keras

    from helpers import keras as training_keras

    for each in {keras, training_keras}:
        each.mixed_precision.set_global_policy("float32")
    yield
    for each in {keras, training_keras}:
        each.mixed_precision.set_global_policy("float32")


def pytest_collection_modifyitems(items):
    # `-m distributed` selects the tests that train under a distribution:
    # those of the `two_replicas` fixture, and those marked so.
    for item in items:
        if "two_replicas" in getattr(item, "fixturenames", ()):
            item.add_marker("distributed")
    if not items or all(str(item.path).startswith(CORE) for item in items):
        return
    from backends import ON_KERAS_2

    # Under Keras 2 only the tests marked `keras_2_too` run.
    if not ON_KERAS_2:
        return
    skip = pytest.mark.skip(reason="Keras 3 only")
    for item in items:
        if item.get_closest_marker("keras_2_too") is None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def two_replicas():
    """Two replicas: a MirroredStrategy over the two logical CPU devices on
    TensorFlow, `keras.distribution.DataParallel` over two CPU devices on
    JAX; skipped on PyTorch. Build, compile and fit inside its `scope()`.
    One instance serves the whole session (see
    `backends.two_replicas_distribution`)."""
    from backends import two_replicas_distribution

    distribution = two_replicas_distribution()
    if isinstance(distribution, str):
        pytest.skip(distribution)
    return distribution
