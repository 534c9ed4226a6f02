"""Keras 2's saving and cloning: names, functional classes, the window.

Only TensorFlow checkpoints (`save_weights` in the TF format,
`tf.train.Checkpoint`, `BackupAndRestore`) carry the window: Keras 2's
`model.save` files (`.keras`, `.h5`, SavedModel) and `.h5` weights cannot,
and saving one with a window open warns (`ModelDifferences`). Checked on
tf_keras 2.21.0 / TF 2.21.0, keras 2.15.0 / TF 2.15.1 and keras 2.13.1 /
TF 2.13.1.
"""

import contextlib
import inspect

from accum_model.tensorflow import checkpoint
from accum_model.core import class_tree
from accum_model.core.patch import wrapped_for_good
from accum_model.keras2.package import src

_cloning = src("models.cloning")
_functional = src("engine.functional")
_object_registration = src("saving.object_registration")
_serialization_lib = src("saving.serialization_lib")

Functional = _functional.Functional


def serialize_as(alias_class, registered_class):
    """Makes Keras 2 serialize `alias_class` under `registered_class`'s name.

    `get_registered_name` reads the private `_GLOBAL_CUSTOM_NAMES`.
    """
    names = _object_registration._GLOBAL_CUSTOM_NAMES
    if registered_class in names:
        names[alias_class] = names[registered_class]


def unsafe_deserialization():
    """A context in which `from_config` rebuilds what Keras's safe mode
    refuses (a `Lambda` of a Python lambda): the private
    `SafeModeScope`."""
    return _serialization_lib.SafeModeScope(False)


def compiled_state_hidden(model):
    """Nothing to hide: Keras 2's `clone_model` does not compile."""
    del model
    return contextlib.nullcontext()


def register_plain_name(cls):
    """Lets Keras 2 find `cls` by its plain name when it loads a model.

    Keras 2 writes a model's `__class__.__name__` into `.h5` files and
    `to_json` (`Model._updated_config`) but registers `package>name`; an
    unknown name fails `load_model` and makes `model_from_json` return the
    name itself. Adds the plain name to the private `_GLOBAL_CUSTOM_OBJECTS`
    unless another class holds it.
    """
    _object_registration._GLOBAL_CUSTOM_OBJECTS.setdefault(cls.__name__, cls)


def functional_constructor_signature():
    """The signature `clone_model` looks for in a functional class."""
    return inspect.signature(Functional.__init__)


def clones_through_constructor(model_class, after):
    """Whether `clone_model` may rebuild a model of `model_class` through a
    constructor whose signature is `Functional.__init__`'s (Keras 2's
    `has_functional_like_constructor` asks for exactly that signature)."""
    return class_tree.next_init_is_keras_model(model_class, after)


def wrap_sequential_cloning(make_wrapper):
    """Wraps what `clone_model` clones a `Sequential` with: the private
    `cloning._clone_sequential_model`, which builds a plain `Sequential`
    whatever the model's class (tf_keras 2.21.0, keras 2.15.0 and 2.13.1),
    looked up in its module at each call.

    Args:
        make_wrapper: Callable taking Keras's function and returning one
            with its signature, `(model, ...) -> clone`.
    """
    wrapped_for_good(_cloning, "_clone_sequential_model", make_wrapper)


class Keras2WindowCheckpoint(checkpoint.TensorFlowWindowCheckpoint):
    """The open window, in TensorFlow checkpoints.

    Keras 2 tracks a `Trackable` attribute of a model as a checkpoint
    dependency, so `save_weights` in the TensorFlow format,
    `tf.train.Checkpoint` and `BackupAndRestore` save and restore it. Keras
    2's `.keras` and `.h5` files hold only Keras objects
    (`saving_lib._is_keras_trackable`), and a SavedModel loaded by
    `load_model` is rebuilt from its config without it.

    Args:
        accumulation: The `Accumulation` whose window is saved.
    """
