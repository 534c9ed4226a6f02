"""Finds the Keras this process trains with, or refuses the stack clearly.

accum_model follows the Keras that trains: Keras 3 (keras >= 3.6 on
TensorFlow, JAX or PyTorch) or Keras 2 (TensorFlow 2.13-2.15's own Keras, or
`tf_keras` with `TF_USE_LEGACY_KERAS=1`). Anything else is refused at import with what was
found, what is needed, and the command that fixes it, instead of an
unrelated error later (or a model that trains nothing).
"""

import importlib.util
import os

# The oldest Keras 3 whose every private detail in `accum_model.keras3` was
# checked (keras 3.6.0 with TensorFlow 2.16.2, in CI), and the oldest
# Keras 2 (TensorFlow 2.13's) that `accum_model.keras2` was written against.
KERAS_FLOOR = (3, 6)
# The Keras 3 backends an adapter exists for.
SUPPORTED_BACKENDS = ("tensorflow", "jax", "torch")
KERAS_2_FLOOR = (2, 13)


def legacy_keras_requested():
    """Whether `TF_USE_LEGACY_KERAS` makes `tf.keras` the `tf_keras` package."""
    return os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")


def check_stack():
    """Returns the Keras behind `tf.keras` (2 or 3) and its backend, or
    raises ImportError."""
    if legacy_keras_requested():
        return _check_tf_keras(), "tensorflow"
    if importlib.util.find_spec("keras") is None:
        raise ImportError(
            "accum_model needs Keras, and keras is not installed. Fix: pip "
            "install 'keras>=3.6' tensorflow (or jax, or torch)"
        )
    import keras
    found = getattr(keras, "__version__", "unknown")
    major_minor = _major_minor(found)
    if major_minor is not None and major_minor[0] == 2:
        if major_minor < KERAS_2_FLOOR:
            raise ImportError(
                f"accum_model needs Keras 2.13 or newer; found keras {found}. "
                "Fix: pip install 'tensorflow>=2.13,<2.16', or Keras 3: pip "
                "install 'keras>=3.6' 'tensorflow>=2.16'"
            )
        return 2, "tensorflow"
    if major_minor is None or major_minor < KERAS_FLOOR:
        raise ImportError(
            f"accum_model needs Keras 3.6 or newer (or Keras 2.13-2.15); "
            f"found keras {found}. Fix: pip install 'keras>=3.6' "
            "'tensorflow>=2.16'"
        )
    backend = keras.backend.backend()
    if backend not in SUPPORTED_BACKENDS:
        raise ImportError(
            "accum_model runs on the Keras backends "
            f"{', '.join(repr(b) for b in SUPPORTED_BACKENDS)}; found "
            f"'{backend}'. Fix: export KERAS_BACKEND=tensorflow (and pip "
            "install tensorflow), KERAS_BACKEND=jax (and pip install jax) "
            "or KERAS_BACKEND=torch (and pip install torch)"
        )
    return 3, backend


def _check_tf_keras():
    try:
        import tf_keras
    except ImportError as error:
        try:
            import tensorflow as tf
        except ImportError:
            # Neither is there (a JAX environment, say).
            requirement = "tensorflow tf-keras"
        else:
            major, minor = _major_minor(tf.__version__)
            requirement = f"'tf-keras~={major}.{minor}.0'"
        raise ImportError(
            "TF_USE_LEGACY_KERAS is set, so `tf.keras` is Keras 2 from the "
            "tf_keras package, which is not installed. Fix: pip install "
            f"{requirement}, or unset TF_USE_LEGACY_KERAS to train with "
            "Keras 3"
        ) from error
    found = getattr(tf_keras, "__version__", "unknown")
    major_minor = _major_minor(found)
    if major_minor is None or major_minor[0] != 2:
        raise ImportError(
            f"TF_USE_LEGACY_KERAS is set and tf_keras {found} is not a "
            "Keras 2. Fix: pip install tf-keras matching your TensorFlow"
        )
    return 2


def _major_minor(version):
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
