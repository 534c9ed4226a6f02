"""Functional construction that never rewrites a class.

`keras.Model.__init__`, given `inputs=`/`outputs=`, injects `Functional`
into the *bases* of the instance's class and of all its ancestors. Done to
AccumulatingModel it would break every later subclass built without inputs.
Instead, a functional instance gets a cached sibling class that derives from
both the requested class and `Functional`, under the same name and module,
so names, name scopes and serialization are those of the requested class.
"""

from accum_model import _keras_private

_functional_variants = {}


def is_functional_call(args, kwargs):
    """Whether constructor arguments ask for a functional model."""
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def functional_variant(cls):
    """Returns a subclass of `cls` and `Functional`, created once per class."""
    if issubclass(cls, _keras_private.Functional):
        return cls
    variant = _functional_variants.get(cls)
    if variant is None:
        variant = type(
            cls.__name__,
            (cls, _keras_private.Functional),
            {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "__doc__": cls.__doc__,
            },
        )
        _keras_private.serialize_as(variant, cls)
        _functional_variants[cls] = variant
    return variant
