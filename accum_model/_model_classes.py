"""The classes an `AccumulatingModel` instance really has.

Keras's `Model.__init__`, given `inputs=`/`outputs=`, injects `Functional`
into the bases of the instance's class *and of every ancestor*, for the rest
of the process. Done to `AccumulatingModel`, to a user's class or to a
keras-hub task, it breaks every later use of those classes built the other
way. accum_model never lets that happen:

* an instance is created as a *routed* class, a subclass of the requested
  class and of `_FunctionalRouter`, which sits just above `keras.Model` in
  the MRO and so receives the `__init__` call that would reach `Model`;
* if that call is functional, the router switches the instance to the
  requested class's *functional variant* (the class and `Functional`) and
  runs `Functional.__init__`; otherwise it gives the instance the requested
  class itself and runs `Model.__init__`.

Both generated classes carry the requested class's name, module and
qualified name, so names, name scopes and serialization are unchanged, and
they are created once per class. No existing class is modified.
"""

import contextlib
import inspect

from accum_model._chooser import adapter
from accum_model._chooser import keras
from accum_model.core import class_tree

_routed_classes = {}
_functional_variants = {}
_settings_bound_variants = {}


def is_functional_call(args, kwargs):
    """Whether constructor arguments ask for a functional model."""
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def is_generated(cls):
    """Whether `cls` is one of the classes made here."""
    return cls.__dict__.get("_accum_model_generated", False)


def requested_class(cls):
    """The user's class behind a generated class (or `cls` itself)."""
    while is_generated(cls):
        cls = cls.__bases__[0]
    return cls


def instance_class(cls):
    """The class `AccumulatingModel.__new__` creates for a request of `cls`."""
    # Routed even when `cls` derives from `Functional` now: Keras injects
    # `Functional` into shared ancestors (a keras-hub `Task`, say) when their
    # plain class is built functionally, and keras-hub resets them again.
    if is_generated(cls):
        return cls
    routed = _routed_classes.get(cls)
    if routed is None:
        routed = subclass_like(cls, (cls, _FunctionalRouter))
        _routed_classes[cls] = routed
    return routed


def functional_variant(cls):
    """Returns a subclass of `cls` and `Functional`, created once per class."""
    cls = requested_class(cls)
    variant = _functional_variants.get(cls)
    if variant is None:
        variant = subclass_like(cls, (cls, adapter.Functional))
        claim_functional_constructor(variant, cls)
        _functional_variants[cls] = variant
    return variant


def with_settings_for_clones(cls, settings):
    """Returns a subclass of the functional `cls` that clones with `settings`.

    `keras.models.clone_model` rebuilds a functional model as
    `type(model)(inputs, outputs, name=...)`, which would forget the
    accumulation settings. Instances are given this subclass. Where `cls`
    clones through its constructor, the subclass's constructor fills in the
    settings the clone did not pass. Where it does not (a keras-hub task
    takes a backbone, not inputs and outputs), plain Keras's clone is a
    plain functional model; this subclass makes it a functional
    `AccumulatingModel` with the same settings instead of failing.
    """
    while cls.__dict__.get("_accum_model_bound_settings"):
        cls = cls.__bases__[0]  # Settings bound before: replaced, not added.
    requested = requested_class(cls)
    base = class_tree.accumulating_base(requested)
    through_constructor = adapter.saving.clones_through_constructor(
        requested, base)
    if through_constructor and not settings:
        return cls
    key = (cls, repr(sorted(settings.items())))
    bound = _settings_bound_variants.get(key)
    if bound is not None:
        return bound
    if through_constructor:

        def __init__(self, *args, **kwargs):
            for name, value in settings.items():
                kwargs.setdefault(name, value)
            super(bound, self).__init__(*args, **kwargs)

        bound = subclass_like(cls, (cls,), namespace={
            "__init__": __init__, "_accum_model_bound_settings": True,
        })
        claim_functional_constructor(bound, requested, __init__)
    else:

        def __new__(klass, *args, **kwargs):
            if is_functional_call(args, kwargs):
                # Python skips `__init__` for an object of another class:
                # this one is built whole here.
                return base(*args, **{**settings, **kwargs})
            return super(bound, klass).__new__(klass, *args, **kwargs)

        bound = subclass_like(cls, (cls,), namespace={
            "__new__": __new__, "_accum_model_bound_settings": True,
        })
    _settings_bound_variants[key] = bound
    return bound


def claim_functional_constructor(subclass, requested, init=None):
    """Gives `subclass` a constructor with `Functional.__init__`'s signature.

    Keras 2 saves a functional model's layers (`Functional.get_config`) and
    `clone_model` rebuilds it through its class only when the class's
    constructor has exactly that signature. Claimed only where the
    constructor the user asked for passes everything on (AccumulatingModel's
    own, or one claimed here); Keras 3 needs nothing (it accepts
    `*args, **kwargs`).
    """
    signature = adapter.saving.functional_constructor_signature()
    passes_everything_on = requested.__init__ is (
        class_tree.accumulating_base(requested).__init__
    ) or getattr(requested.__init__, "_accum_model_claimed", False)
    if signature is None or not passes_everything_on:
        return
    if init is None:

        def init(self, *args, **kwargs):
            super(subclass, self).__init__(*args, **kwargs)

        subclass.__init__ = init
    init.__signature__ = signature
    init._accum_model_claimed = True


def subclass_like(like, bases, namespace=None, generated=True,
                  serialized_as=None):
    """A class named like `like`, serialized under `serialized_as`'s name."""
    subclass = type(
        like.__name__,
        bases,
        {
            "__module__": like.__module__,
            "__qualname__": like.__qualname__,
            "__doc__": like.__doc__,
            "_accum_model_generated": generated,
            **(namespace or {}),
        },
    )
    adapter.saving.serialize_as(subclass, serialized_as or like)
    return subclass


class _FunctionalRouter(keras.Model):
    """Receives the `keras.Model.__init__` call and routes it (see above)."""

    _accum_model_router = True

    def __init__(self, *args, **kwargs):
        if is_functional_call(args, kwargs):
            self.__class__ = functional_variant(type(self))
            adapter.Functional.__init__(self, *args, **kwargs)
        else:
            if not isinstance(self, adapter.Functional):
                self.__class__ = requested_class(type(self))
            keras.Model.__init__(self, *args, **kwargs)


@contextlib.contextmanager
def ancestors_kept(cls):
    """Puts back the bases of `cls`'s ancestors that its constructor changed.

    keras-hub's `PipelineModel.__init__` resets its own bases to
    `keras.Model`, undoing the `Functional` that Keras injected when a plain
    task was built; a plain task's `Model.__init__` injects it again, but
    an accumulating one's does not (see above), which left the plain tasks
    built before it without `Functional.call`. Checked on keras-hub 0.32.0.
    """
    saved = [(ancestor, ancestor.__bases__)
             for ancestor in requested_class(cls).__mro__[1:]
             if ancestor is not object]
    try:
        yield
    finally:
        for ancestor, bases in saved:
            if ancestor.__bases__ != bases:
                ancestor.__bases__ = bases


def takes_keyword(function, name):
    """Whether `function` accepts the keyword argument `name`."""
    parameters = inspect.signature(function).parameters.values()
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD
               for p in parameters)
