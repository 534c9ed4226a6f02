"""Replacing a module's functions for the length of a `with` block."""

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
