"""Keras 3's saving and cloning: names, functional classes, the window.

Checked on keras 3.6.0 / TF 2.16.2, 3.10.0 / TF 2.18.1 and 3.15.1 /
TF 2.21.0 (the tests that exercise each helper pass, `.ci/matrix`).
"""

import contextlib

from keras.src.models import cloning
from keras.src.models.functional import functional_like_constructor
from keras.src.saving import object_registration
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.saving.serialization_lib import SafeModeScope

from accum_model.core import class_tree
from accum_model.core.patch import wrapped_for_good


def serialize_as(alias_class, registered_class):
    """Makes Keras serialize `alias_class` under `registered_class`'s name.

    `keras.saving.get_registered_name` reads the private
    `GLOBAL_CUSTOM_NAMES`; the name still resolves to `registered_class` when
    loading, because `GLOBAL_CUSTOM_OBJECTS` is left as it is.
    """
    names = object_registration.GLOBAL_CUSTOM_NAMES
    if registered_class in names:
        names[alias_class] = names[registered_class]


def unsafe_deserialization():
    """A context in which `from_config` rebuilds what Keras's safe mode
    refuses (a `Lambda` of a Python lambda, a `TorchModuleWrapper`'s
    module): the private `SafeModeScope`."""
    return SafeModeScope(False)


@contextlib.contextmanager
def compiled_state_hidden(model):
    """A context in which `model` reads as not compiled: `clone_model`
    compiles its clone from the model's compile config (keras 3.10 and
    3.15.1, not 3.6), which fails on a loss function Keras cannot find by
    name, where the caller compiles the clone itself."""
    compiled = getattr(model, "compiled", False)
    model.compiled = False
    try:
        yield
    finally:
        model.compiled = compiled


def register_plain_name(cls):
    """Nothing to do: Keras 3 writes and reads the registered name."""
    del cls


def functional_constructor_signature():
    """None: Keras 3's `clone_model` accepts a constructor taking
    `*args, **kwargs` as functional-like."""
    return None


def clones_through_constructor(model_class, after):
    """Whether `keras.models.clone_model` rebuilds via `model_class(...)`.

    Keras's `functional_like_constructor` decides from the constructor's
    signature; the accumulating class's own signature (`after`'s) passes
    every argument on, so the class after it in the MRO is the one that
    must accept them.
    """
    if class_tree.next_init_is_keras_model(model_class, after):
        return True
    return functional_like_constructor(
        class_tree.next_init_class(model_class, after)
    )


def wrap_sequential_cloning(make_wrapper):
    """Wraps what `keras.models.clone_model` clones a `Sequential` with.

    `clone_model` hands every `Sequential` to the private
    `cloning._clone_sequential_model`, which builds the clone as a plain
    `keras.Sequential`, whatever the model's class, asking the model for
    nothing (keras 3.6.0, 3.10.0 and 3.15.1). Looked up in its module at
    each call, it is wrapped there: every alias of `clone_model` (`keras.
    models`, `tf.keras.models`) reaches the wrapper.

    Args:
        make_wrapper: Callable taking Keras's function and returning one
            with its signature, `(model, ...) -> clone`.
    """
    wrapped_for_good(cloning, "_clone_sequential_model", make_wrapper)


class InKerasFiles(KerasSaveable):
    """Puts a `core.checkpoint_layout.RestoredWindow` (the open window) in
    Keras files: `save_weights`, `.keras`, `ModelCheckpoint`,
    `BackupAndRestore`, on every backend.

    `saving_lib._walk_saveable` visits every attribute of the model that is
    a `KerasSaveable`, private ones last, and calls its `save_own_variables`
    / `load_own_variables` with an entry of its own; a file without that
    entry gives an empty one, and a model without the attribute never asks
    for it (a plain `keras.Model` loads such a file). Nothing is stored
    while no window exists, so the file stays what a plain model writes.
    """

    def _obj_type(self):
        # Which of Keras's attribute skip-sets applies when the saver walks
        # this object; it holds no Keras objects of its own.
        return "Layer"

    def save_own_variables(self, store):
        if self.has_state():
            for key, value in self.with_sizer_state(
                    self.saved_state()).items():
                store[key] = value

    def load_own_variables(self, store):
        self.restore_state({key: store[key] for key in store.keys()})
