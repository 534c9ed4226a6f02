"""Questions about a model class's MRO, the same for every Keras.

Which classes override a Keras method, what their code refers to, and which
`__init__` comes after the accumulating base class's. Keras's own classes
live in the `keras` package (Keras 3, and TensorFlow 2.13-2.15's Keras 2) or
in `tf_keras`; they are recognised by their module's name, so this module
imports no Keras.
"""

import inspect
import types

_KERAS_PACKAGES = ("keras", "tf_keras")


def layers_of(model):
    """The model and every layer in it, through the private
    `Layer._flatten_layers` that both Kerases have (checked on keras
    3.6.0-3.15.1, TensorFlow 2.13.1's Keras and tf_keras 2.21.0)."""
    return [model] + list(model._flatten_layers(include_self=False))


def is_keras_class(cls):
    return cls.__module__.split(".")[0] in _KERAS_PACKAGES or cls is object


def accumulating_base(model_class):
    """The class in `model_class`'s MRO that marks itself as the base.

    AccumulatingModel sets `_accum_model_base = True` in its own namespace
    (subclasses inherit the attribute, not the entry), so classes below the
    model layer can find it without importing it.
    """
    for cls in model_class.__mro__:
        if cls.__dict__.get("_accum_model_base", False):
            return cls
    raise TypeError(f"{model_class.__name__} is not an accumulating class")


def has_default_micro_batch_weight(model_class):
    """Whether `model_class` keeps the built-in `micro_batch_weight`."""
    base = accumulating_base(model_class)
    return model_class.micro_batch_weight is base.micro_batch_weight


def next_init_class(model_class, after):
    """The first class after `after` in `model_class`'s MRO with an `__init__`.

    Args:
        model_class: The class whose MRO is walked.
        after: A class in that MRO (AccumulatingModel, in practice).
    """
    mro = model_class.__mro__
    for cls in mro[mro.index(after) + 1:]:
        if "__init__" in cls.__dict__:
            return cls
    return object


def next_init_is_keras_model(model_class, after):
    """Whether the `__init__` after `after`'s is Keras's own."""
    cls = next_init_class(model_class, after)
    return is_keras_class(cls) or getattr(cls, "_accum_model_router", False)


def overriding_classes(model_class, method_name, start_after=None,
                       stop_at=None):
    """Classes in `model_class`'s MRO, other than Keras's, that define a method.

    Looks after `start_after` (if given) and before `stop_at` (if given).
    """
    mro = model_class.__mro__
    if start_after is not None:
        mro = mro[mro.index(start_after) + 1:]
    found = []
    for cls in mro:
        if cls is stop_at or is_keras_class(cls):
            break
        if method_name in cls.__dict__:
            found.append(cls)
    return found


def names_used_by_overrides(model_class, method_name, stop_at):
    """Global names used by user overrides of a Keras model method.

    Walks `model_class`'s MRO up to `stop_at` (or to Keras's own classes)
    and collects the names each override's code refers to, nested functions
    included. Returns None when no class overrides the method.
    """
    overriding = overriding_classes(model_class, method_name, stop_at=stop_at)
    if not overriding:
        return None
    names = set()
    for cls in overriding:
        names |= names_used_by(cls.__dict__[method_name])
    return names


def names_used_by(function):
    """Global names a function's code refers to, nested functions included."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    codes = [code] if code is not None else []
    names = set()
    while codes:
        code = codes.pop()
        names |= set(code.co_names)
        codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return names


# What a training step of the user's own calls to hand its gradients to the
# window, on a stateful and a stateless backend.
WINDOW_HOOKS = frozenset({"accumulate_gradients",
                          "stateless_accumulate_gradients"})


def own_step_feeds_window(model_class):
    """Whether `model_class` trains with a `train_step` of its own (below
    the accumulating base) that hands gradients to the window itself."""
    names = names_used_by_overrides(model_class, "train_step",
                                    stop_at=accumulating_base(model_class))
    return bool(names and WINDOW_HOOKS & names)
