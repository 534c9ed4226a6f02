"""Warnings and error texts that more than one layer gives."""

import difflib
import sys


# Modules a warning never points into: it points at the user's line that
# reached them (a `fit()` call, a constructor).
_LIBRARIES = ("accum_model", "keras", "tensorflow", "tf_keras", "jax",
              "contextlib", "functools")


def user_stacklevel():
    """The `stacklevel` that makes a warning raised by this function's
    caller point at the first frame outside accum_model and the libraries
    under it: the user's own line."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and str(
            frame.f_globals.get("__name__", "")).split(".")[0] in _LIBRARIES:
        frame = frame.f_back
        level += 1
    return level


def names_in_brief(names, listing, shown=3):
    """`names` for a message: all of a few, else a count, the first
    `shown` and how to list the rest (`listing`)."""
    names = list(names)
    if len(names) <= shown + 1:
        return str(names)
    return (f"{len(names)} ({', '.join(names[:shown])}, ...; {listing} "
            "lists them all)")


def unexpected_keyword(function, name, value, known, listed=False):
    """Says that `function` takes no keyword `name` (given `value`),
    with the closest of the `known` names, and all of them if `listed`."""
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    takes = f" It takes {', '.join(known)}." if listed else ""
    return (f"{function}() got an unexpected keyword argument {name!r}."
            f"{hint}{takes} Received: {name}={value!r}")


def counted(count, noun):
    """`count` and `noun`, plural unless the count is one: "1 window",
    "3 micro-batches"."""
    plural = noun[:-1] + "ies" if noun.endswith("y") else noun + (
        "es" if noun.endswith("h") else "s")
    return f"{count} {noun if count == 1 else plural}"


def window_is_open(open_steps):
    """Says that a window holds `open_steps` micro-batches, and the fix.

    Args:
        open_steps: Int > 0. Micro-batches accumulated and not yet applied.
    """
    return (
        f"a window open ({counted(open_steps, 'micro-batch')} accumulated "
        "and not yet "
        "applied). Call `model.apply_open_window()` first"
    )


def windows_cut_by_epoch(epoch_steps, window_length):
    """Says that every window of an epoch of `epoch_steps` micro-batches
    ends at the epoch's end, before its `window_length`, and the fixes."""
    return (
        f"Each epoch has {counted(epoch_steps, 'micro-batch')}, fewer than "
        f"a window (n_gradients={window_length}): with "
        "flush_each_epoch=True every window ends at the epoch's end, so "
        f"each update is the mean over {epoch_steps}, not {window_length}. "
        f"Set n_gradients <= {epoch_steps}, give each epoch more "
        "micro-batches (a smaller batch_size or more steps_per_epoch), or "
        "set flush_each_epoch=False to let windows run across epochs."
    )


def float16_check_of_reused_weights(layer_names):
    """Says that layers using their weights more than once in a step may
    see a window skipped (or applied) unlike the large batch under float16
    loss scaling, and what is exact."""
    return (
        f"Layers {layer_names} use their weights more than once in a step "
        "(a shared or recurrent layer) and compute in float16 under loss "
        "scaling. The window tells whether the large batch's float16 "
        "gradient overflows from the sum of a weight's gradients over its "
        "uses, while the large batch overflows in each use's own float16 "
        "part: a window near float16's range may be skipped where the "
        "large batch is not, or the reverse, and the two then part. To "
        "follow the large batch's skips exactly, give these layers "
        "dtype='float32', or train under 'mixed_bfloat16' (no loss "
        "scaling)."
    )
