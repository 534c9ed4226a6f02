"""Warnings and error texts that more than one layer gives."""

import warnings

_warned = set()


def warn_once(key, message, stacklevel=4):
    """Warns with `message` the first time it is given for `key`."""
    if (key, message) in _warned:
        return
    _warned.add((key, message))
    warnings.warn(message, stacklevel=stacklevel)


def window_is_open(open_steps):
    """Says that a window holds `open_steps` micro-batches, and the fix.

    Args:
        open_steps: Int > 0. Micro-batches accumulated and not yet applied.
    """
    return (
        f"a window open ({open_steps} micro-batches accumulated and not yet "
        "applied). Call `model.apply_open_window()` first"
    )
