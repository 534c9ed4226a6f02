"""What the benchmarks share: the machine a figure was taken on, the JSON
they write, launching worker processes on 127.0.0.1, counting collectives
in a traced step, and plain Keras under two workers.

Backends are imported where a function needs them, so that every benchmark
(and the tests that count collectives with the same functions) can import
this module on any backend.
"""

import functools
import json
import math
import os
import pathlib
import platform
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parent.parent


def backend_version():
    """The backend Keras runs on and its version, e.g. "jax 0.10.2"."""
    import keras

    backend = keras.backend.backend()
    if backend not in ("tensorflow", "jax", "torch"):
        return backend
    return f"{backend} {__import__(backend).__version__}"


def machine(cores_note=""):
    """One line naming the processor, its cores, Python, the backend and
    Keras, for a figure's record."""
    import keras

    cores = f"{os.cpu_count()} cores" + (f" ({cores_note})" if cores_note
                                         else "")
    return (f"{platform.processor() or platform.machine()}, {cores}, Python "
            f"{platform.python_version()}, {backend_version()}, keras "
            f"{keras.__version__}")


def commit(path=ROOT):
    """The short commit of the checkout at `path`, or "unknown"."""
    result = subprocess.run(["git", "-C", str(path), "rev-parse", "--short",
                             "HEAD"], capture_output=True, text=True)
    return result.stdout.strip() or "unknown"


def write_json(path, results):
    """Writes `results` to `path` as indented JSON, making its folder."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")


# Worker processes -------------------------------------------------------------
# The launcher of the multi-process examples, which the tests run: free ports
# on 127.0.0.1, and processes run at once with none left behind.


def _processes():
    import sys

    examples = str(ROOT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import processes

    return processes


def free_ports(count):
    """`count` TCP ports free on 127.0.0.1 now."""
    return _processes().free_ports(count)


def run_bounded(commands, timeout, stop_all_on_failure=False):
    """Runs `commands` at once; returns their (exit code, output) in order,
    killing and reaping them all on timeout or error (and, with
    `stop_all_on_failure`, once one fails)."""
    return _processes().run_bounded(commands, timeout, stop_all_on_failure)


# Collectives in a traced TensorFlow step --------------------------------------


def traced_step(model, strategy, x, y):
    """The GraphDef of one training step, as `fit()` would run it."""
    import tensorflow as tf

    model.make_train_function()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    element = next(iter(strategy.experimental_distribute_dataset(dataset)))
    step = tf.function(lambda data: strategy.run(model.train_step, (data,)))
    return step.get_concrete_function(element).graph.as_graph_def()


def collective_reductions(graph_def, num_replicas):
    """Counts the reductions run on every step and those under a condition.

    Each replica runs its own collective op for one reduction, so ops are
    divided by the number of replicas.
    """
    library = {f.signature.name: f for f in graph_def.library.function}
    counts = {"every_step": 0, "conditional": 0}

    def visit(nodes, conditional):
        for node in nodes:
            if node.op.startswith(("Collective", "Nccl")):
                counts["conditional" if conditional else "every_step"] += 1
            for key in ("then_branch", "else_branch", "f", "body", "cond"):
                if key in node.attr and node.attr[key].func.name:
                    visit(library[node.attr[key].func.name].node_def,
                          conditional or key.endswith("_branch"))

    visit(graph_def.node, False)
    return {k: v / num_replicas for k, v in counts.items()}


def plain_keras_class():
    """`keras.Model` able to train under two MultiWorkerMirroredStrategy
    workers on Keras 3 (TensorFlow), with its own step and reductions.

    keras 3.15.1's `fit()` fails there before training: its symbolic build
    reduces the first distributed batch, and its log reduction cannot
    reduce scalars over workers (docs/distribution.md). The two overrides
    below build from the first replica's local batch and give each scalar
    log one axis; neither changes the arithmetic or the gradient reductions.
    """
    import keras
    import tensorflow as tf

    class PlainKeras(keras.Model):

        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            if iterator is None:
                return super()._maybe_symbolic_build(iterator, data_batch)
            strategy = self.distribute_strategy
            for step in iterator:
                batch = next(step[-1])  # (..., data iterator)
                break
            else:
                return None

            def local(value):
                if isinstance(value, tf.distribute.DistributedValues):
                    return strategy.experimental_local_results(value)[0]
                return value

            with strategy.scope():
                self._symbolic_build(
                    data_batch=tf.nest.map_structure(local, batch))
            return None

        def train_step(self, data):
            return {name: tf.reshape(value, [1]) if value.shape.rank == 0
                    else value
                    for name, value in super().train_step(data).items()}

    return PlainKeras


# The compiled JAX step ------------------------------------------------------


def jax_compiled_step(model, x, y):
    """`model`'s training step on a batch `(x, y)`, jitted as Keras's
    `fit()` jits it (the state donated) and compiled, after one
    `train_on_batch` that builds the model (and an accumulating model's
    window)."""
    import jax

    model.train_on_batch(x, y)
    model.make_train_function()
    state = model._get_jax_state(
        trainable_variables=True, non_trainable_variables=True,
        optimizer_variables=True, metrics_variables=True)
    step = jax.jit(functools.partial(type(model).train_step, model),
                   donate_argnums=0)
    return step.lower(state, (x, y)).compile()


def jax_distributed_step_text(model, distribution, x, y, batch_size=8):
    """The optimised HLO text of one JAX training step under
    `distribution`, compiled as Keras's `fit()` compiles it (after one
    epoch on `(x, y)`, which builds the model, its optimizer and the
    window; with several processes, `(x, y)` are this process's rows)."""
    import jax
    import keras
    from keras.src.backend.jax.trainer import _distribute_data

    with distribution.scope():
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False,
                  verbose=0)
        state = model._get_jax_state(
            trainable_variables=True, non_trainable_variables=True,
            optimizer_variables=True, metrics_variables=True)
        data = _distribute_data((x[:batch_size], y[:batch_size]))
        # Keras before 3.11 (checked on 3.10.0) forgets the state's layout
        # when fit() ends, and its step constrains the state to it.
        record = getattr(model, "_record_training_state_sharding_spec", None)
        if record is not None:
            record()
        # Keras before 3.11 jits without out_shardings (its step constrains
        # the layout itself).
        step = jax.jit(model.train_step, out_shardings=(
            None, model._get_state_sharding_spec()
            if hasattr(keras.Model, "_get_state_sharding_spec") else None))
        return step.lower(state, data).compile().as_text()


def jax_all_reduces(hlo_text):
    """The elements all-reduced in the entry computation (every step) and
    in the computations it calls (the window end's branch), as
    `{"every_step": n, "conditional": n}`."""
    elements = {"every_step": 0, "conditional": 0}
    place = None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            place = ("every_step" if line.startswith("ENTRY")
                     else "conditional")
            continue
        found = re.search(r"=\s*(.*?)\sall-reduce(-start)?\(", line)
        if found:
            elements[place] += sum(
                math.prod(int(d) for d in dims.split(",") if d)
                for dims in re.findall(r"\w+\[([\d,]*)\]", found.group(1)))
    return elements


def jax_step_memory(model, x, y):
    """`memory_analysis()` of `model`'s compiled training step (see
    `jax_compiled_step`)."""
    return jax_compiled_step(model, x, y).memory_analysis()
