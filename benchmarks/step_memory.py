"""What a micro step holds in memory, against plain Keras at the micro-batch.

JAX: the compiled step's own account (`memory_analysis()` of the training
step jitted as Keras's `fit()` jits it, the state donated): its arguments
(weights, optimizer slots and, for the window, its gradient sums) and its
temporaries, for plain Keras and for an `AccumulatingModel`, in float32
copies of the trainable weights. The floor is plain Keras plus one copy, the
window's sums.

PyTorch: the peak resident memory of a fresh process that trains a few
windows (`ru_maxrss`), plain Keras against the window, in the same copies.
A CPU process's peak also holds what the allocator keeps, so read it to
about a tenth of a copy.

Run: KERAS_BACKEND=jax python benchmarks/step_memory.py [--out DIR]
     KERAS_BACKEND=torch python benchmarks/step_memory.py [--out DIR]
"""

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402
from harness import jax_step_memory  # noqa: E402
from harness import machine  # noqa: E402
from harness import write_json  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WINDOW = 8
MIB = 2 ** 20


def _mlp(width, depth):
    def build(model_class, **kwargs):
        inputs = keras.Input((width,))
        hidden = inputs
        for _ in range(depth):
            hidden = keras.layers.Dense(width, activation="relu")(hidden)
        return model_class(inputs, keras.layers.Dense(10)(hidden), **kwargs)

    def data(n):
        rng = np.random.default_rng(0)
        return (rng.normal(size=(n, width)).astype("float32"),
                rng.integers(0, 10, (n,)))

    return build, data, 32


def _resnet(model_class, **kwargs):
    backbone = keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3), classes=10)
    if model_class is keras.Model:
        return backbone
    return model_class(backbone.inputs, backbone.outputs, **kwargs)


def _images(n):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 32, 32, 3)).astype("float32"),
            rng.integers(0, 10, (n,)))


MODELS = {
    "mlp_8x512": _mlp(512, 8),
    "mlp_2x1024": _mlp(1024, 2),
    "mlp_2x4096": _mlp(4096, 2),
    "resnet50_32x32": (_resnet, _images, 8),
}
# A process's peak resident memory holds a few MiB of noise: PyTorch's
# figures come from models whose copies of the weights are far larger.
DEFAULT_MODELS = {
    "jax": ("mlp_8x512", "mlp_2x1024", "resnet50_32x32"),
    "torch": ("mlp_2x4096", "resnet50_32x32"),
}
# bfloat16 matrix products are slow on a CPU: PyTorch's runs are float32.
POLICIES = {"jax": ("float32", "mixed_bfloat16"), "torch": ("float32",)}


def _compiled(name, accumulating, policy):
    build, _, _ = MODELS[name]
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model = (build(AccumulatingModel, n_gradients=WINDOW) if accumulating
             else build(keras.Model))
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=name.startswith("mlp")))
    return model


def _weight_bytes(model):
    return sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)


def jax_figures(name, policy):
    """The compiled step's arguments and temporaries, plain and
    accumulating, in float32 copies of the trainable weights."""
    _, data, batch = MODELS[name]
    x, y = data(batch)
    figures = {}
    for label, accumulating in (("plain", False), ("accumulating", True)):
        model = _compiled(name, accumulating, policy)
        analysis = jax_step_memory(model, x, y)
        copies = float(_weight_bytes(model))
        figures["weights_mib"] = copies / MIB
        figures[label] = {
            "arguments": analysis.argument_size_in_bytes / copies,
            "temporaries": analysis.temp_size_in_bytes / copies,
            "outputs_not_aliased": (analysis.output_size_in_bytes
                                    - analysis.alias_size_in_bytes) / copies,
        }
        figures[label]["total"] = sum(figures[label].values())
    figures["beyond_plain"] = (figures["accumulating"]["total"]
                               - figures["plain"]["total"])
    keras.mixed_precision.set_global_policy("float32")
    return figures


def _torch_peak_child(name, policy, accumulating):
    """In a child process: trains 3 windows, prints the peak RSS and the
    weights' bytes as JSON."""
    import torch

    torch.set_num_threads(1)
    _, data, batch = MODELS[name]
    x, y = data(batch * WINDOW)
    model = _compiled(name, accumulating, policy)
    for _ in range(3):
        for start in range(0, batch * WINDOW, batch):
            model.train_on_batch(x[start:start + batch],
                                 y[start:start + batch])
    print(json.dumps({
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        * 1024, "weight_bytes": _weight_bytes(model)}))


def torch_peak_figures(name, policy):
    """Each model's peak resident memory in a fresh process, and the
    window's beyond plain Keras, in float32 copies of the weights."""
    figures = {}
    for label, accumulating in (("plain", False), ("accumulating", True)):
        result = subprocess.run(
            [sys.executable, __file__, "--torch-child", name, policy,
             str(int(accumulating))], capture_output=True, text=True,
            check=True, env={**os.environ, "KERAS_BACKEND": "torch"})
        child = json.loads(result.stdout.strip().splitlines()[-1])
        figures["weights_mib"] = child["weight_bytes"] / MIB
        figures[label] = {"peak_mib": child["peak_bytes"] / MIB}
    figures["beyond_plain"] = (
        (figures["accumulating"]["peak_mib"] - figures["plain"]["peak_mib"])
        / figures["weights_mib"])
    return figures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--models", nargs="*", choices=list(MODELS),
                        help="default: each backend's in DEFAULT_MODELS")
    parser.add_argument("--torch-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.torch_child:
        name, policy, accumulating = args.torch_child
        _torch_peak_child(name, policy, accumulating == "1")
        return
    backend = keras.backend.backend()
    measure = {"jax": jax_figures, "torch": torch_peak_figures}.get(
        backend)
    if measure is None:
        sys.exit(f"KERAS_BACKEND must be jax or torch; got {backend}")
    print(machine())
    results = {"machine": machine(), "window": WINDOW, "models": {}}
    for name in args.models or DEFAULT_MODELS[backend]:
        for policy in POLICIES[backend]:
            figures = measure(name, policy)
            results["models"][f"{name}/{policy}"] = figures
            if backend == "jax":
                detail = "  ".join(
                    f"{label} args {figures[label]['arguments']:.3f} temps "
                    f"{figures[label]['temporaries']:.3f}"
                    for label in ("plain", "accumulating"))
            else:
                detail = "  ".join(
                    f"{label} peak {figures[label]['peak_mib']:.0f} MiB"
                    for label in ("plain", "accumulating"))
            print(f"{name:15s} {policy:15s} weights "
                  f"{figures['weights_mib']:6.1f} MiB  {detail}  beyond "
                  f"plain {figures['beyond_plain']:.3f} copies")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    write_json(os.path.join(args.out, f"step_memory-{backend}-{stamp}.json"),
               results)


if __name__ == "__main__":
    main()
