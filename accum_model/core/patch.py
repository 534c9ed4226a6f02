"""Replacing a module's functions: for the length of a `with` block, or
for good where a public function must keep what the package adds."""

import contextlib


def identity(value):
    """Returns `value`: stands in for a function whose effect is undone."""
    return value


@contextlib.contextmanager
def replaced(module, replacements):
    """Sets `module`'s attributes to `replacements` inside the block.

    Names the module lacks are left alone (a Keras that has no such
    function has nothing to replace). The originals are put back however
    the block ends.

    Args:
        module: The module whose functions are replaced.
        replacements: Dict from attribute name to the replacement.
    """
    saved = {name: getattr(module, name) for name in replacements
             if hasattr(module, name)}
    for name in saved:
        setattr(module, name, replacements[name])
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(module, name, original)


def wrapped_for_good(module, name, make_wrapper):
    """Replaces function `name` of `module` by a wrapper of it, for good.

    Callers that look the name up in `module` when they run (the module's
    own functions) reach the wrapper. A second call finds the wrapper in
    place and changes nothing.

    Args:
        module: The module that defines the function.
        name: Str. Its name.
        make_wrapper: Callable taking the function, returning its wrapper.
    """
    original = getattr(module, name)
    if getattr(original, "_accum_model_wrapper", False):
        return
    wrapper = make_wrapper(original)
    wrapper._accum_model_wrapper = True
    setattr(module, name, wrapper)
