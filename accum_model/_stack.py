"""Refuses, at import, a Keras/TensorFlow stack accum_model cannot run on.

Each message names what was found, what is needed, and the command that
fixes it, instead of an unrelated error later (or a model that trains
nothing: Keras 2 layers inside a Keras 3 model).
"""

import os

# The oldest Keras whose every private detail in `_keras_private` was
# checked (keras 3.6.0 with TensorFlow 2.16.2, in CI).
KERAS_FLOOR = (3, 6)


def check_stack():
    """Raises ImportError unless Keras 3 >= the floor runs on TensorFlow."""
    try:
        import keras
    except ImportError as error:
        raise ImportError(
            "accum_model needs Keras 3 on TensorFlow, and keras is not "
            "installed. Fix: pip install 'keras>=3.6' tensorflow"
        ) from error
    found = getattr(keras, "__version__", "unknown")
    major_minor = _major_minor(found)
    if major_minor is None or major_minor < KERAS_FLOOR:
        raise ImportError(
            f"accum_model needs Keras 3 (keras>=3.6); found keras {found}"
            + (" (Keras 2, e.g. TensorFlow 2.15's own)"
               if found.startswith("2.") else "")
            + ". Fix: pip install 'keras>=3.6' 'tensorflow>=2.16'"
        )
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ImportError(
            "accum_model trains with TensorFlow's distribution strategies and "
            f"needs the Keras backend 'tensorflow'; found '{backend}'. Fix: "
            "export KERAS_BACKEND=tensorflow (and pip install tensorflow)"
        )
    if os.environ.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true"):
        raise ImportError(
            "TF_USE_LEGACY_KERAS is set, so `tf.keras` is Keras 2 (tf_keras) "
            "while accum_model is a Keras 3 model: Keras 2 layers inside it "
            "would train nothing. Keras 2 is not supported. Fix: unset "
            "TF_USE_LEGACY_KERAS and build the model with `keras` (Keras 3)."
        )


def _major_minor(version):
    parts = version.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
