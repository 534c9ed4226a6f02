"""Questions about a Keras variable that every backend asks alike."""


def is_overwritten_with_gradient(variable):
    """Whether Keras assigns this variable its "gradient" (float8 stats)."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def short_name(variable):
    """The variable's path (or name) as one word, for naming its copies."""
    name = getattr(variable, "path", None) or variable.name
    return name.replace("/", "_").replace(":", "_")


def flatten(structure):
    """The leaves of nested lists, tuples and dicts (dicts by sorted key),
    as `tf.nest.flatten` and `keras.tree.flatten` give them."""
    if isinstance(structure, dict):
        return [leaf for key in sorted(structure)
                for leaf in flatten(structure[key])]
    if isinstance(structure, (list, tuple)):
        return [leaf for item in structure for leaf in flatten(item)]
    return [structure]
