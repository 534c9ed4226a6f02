"""Keras 3's training loop, as a window needs it, on every backend.

Each helper names the private member it touches, so a Keras upgrade is one
file to review. Where Keras 3 versions differ, the helper detects what the
running Keras offers rather than reading its version. Checked on keras
3.6.0, 3.10.0 and 3.15.1 (TensorFlow) and 3.15.1 (JAX); see
`tensorflow_adapter`, `jax_adapter` and `torch_adapter` for each
backend's own.
"""

import inspect
import math

import keras
from keras.src.models.functional import Functional


def steps_per_execution(model):
    return int(getattr(model, "steps_per_execution", 1) or 1)


def micro_steps_in_epoch(steps, steps_per_execution):
    """Steps an epoch of `steps` runs: Keras 3 runs whole executions, so up
    to the next multiple of `steps_per_execution`."""
    return math.ceil(steps / steps_per_execution) * steps_per_execution


def model_keyword_arguments(functional):
    """Keyword arguments Keras's model constructor accepts.

    `Layer.__init__` names its keywords and also pops `input_dim` and
    `input_shape` from `**kwargs` (keras 3.15.1); `Functional.__init__` adds
    `inputs`, `outputs` and passes on only `name` and `trainable`.
    """
    names = {
        name
        for name, parameter in inspect.signature(
            keras.layers.Layer.__init__
        ).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    } | {"name", "input_dim", "input_shape"}
    if functional:
        names |= set(inspect.signature(Functional.__init__).parameters)
        names.discard("self")
        names.discard("kwargs")
    return names


def calls_in_graph(model):
    """How many times one call of `model` calls each layer, where its
    functional graphs show it: `{id(layer): calls}`.

    Walks the private `_nodes_by_depth` of a `Functional` (and the
    `_functional` a built `Sequential` runs), into nested ones; a layer
    called from inside another kind of layer is not counted. Checked on
    keras 3.6.0, 3.10.0 and 3.15.1.
    """
    counts = {}

    def walk(graph, times):
        graph = getattr(graph, "_functional", None) or graph
        for nodes in getattr(graph, "_nodes_by_depth", {}).values():
            for node in nodes:
                layer = node.operation
                if layer is None or node.is_input:
                    continue
                counts[id(layer)] = counts.get(id(layer), 0) + times
                walk(layer, times)

    walk(model, 1)
    return counts
