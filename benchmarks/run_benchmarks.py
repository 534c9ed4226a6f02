"""Measure what accumulation costs: time per micro-batch, memory, window cost.

Prints a table and writes `results.md`, `results.json` and `results.png` to
the output folder. Not part of the test suite.

Run: python benchmarks/run_benchmarks.py            (about 15 minutes, 2 cores)
     python benchmarks/run_benchmarks.py --quick    (a smoke run)
     python benchmarks/run_benchmarks.py --device gpu   (on a CUDA machine)
     python benchmarks/run_benchmarks.py --backend jax --overhead-only
         (the CPU table on Keras 3's JAX backend; results under jax/;
         `--backend torch` for PyTorch, under torch/)

`--device gpu` runs the GPU suite instead: a ResNet-50 on synthetic
224x224 images and keras-hub's GPT-2 small causal LM (from a config, on
random sequences of 512 tokens; needs keras-hub), plain Keras at micro-batch b and at n*b against
`AccumulatingModel` at b with n_gradients=n, in float32, mixed_float16 and
float32 with `jit_compile=True` (on JAX and PyTorch: float32,
mixed_float16 and mixed_bfloat16); time per micro-batch and peak GPU
memory (`tf.config.experimental.get_memory_info`; on JAX the device's
`memory_stats()`, warm-up included; on PyTorch
`torch.cuda.max_memory_allocated()`), each configuration in a fresh
process. Results go to `gpu_results.md` / `gpu_results.json`, with the
device's name (`--backend jax --device gpu` under `jax/`, `--backend
torch` under `torch/`).
"""

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# Keras reads its backend when imported: `--backend` is read first.
BACKEND = (sys.argv[sys.argv.index("--backend") + 1]
           if "--backend" in sys.argv else "tensorflow")
os.environ["KERAS_BACKEND"] = BACKEND
if BACKEND == "jax":
    # One thread per op, as the TensorFlow runs below (see main()).
    os.environ.setdefault(
        "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false "
        "intra_op_parallelism_threads=1")
if BACKEND == "torch":
    import torch  # noqa: E402

    torch.set_num_threads(1)

import keras  # noqa: E402
import numpy as np  # noqa: E402

if BACKEND == "tensorflow":
    import tensorflow as tf  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402
from harness import backend_version  # noqa: E402
from harness import machine  # noqa: E402
from harness import write_json  # noqa: E402

MICRO_BATCH = 32
N_GRADIENTS = 4
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                           "results")


# Models and data ------------------------------------------------------------


def build(name, model_class, **kwargs):
    keras.utils.set_random_seed(0)
    if name == "mlp":
        inputs = keras.Input((256,))
        x = keras.layers.Dense(512, activation="relu")(inputs)
        x = keras.layers.Dense(512, activation="relu")(x)
        outputs = keras.layers.Dense(10)(x)
    elif name == "cnn":
        inputs = keras.Input((32, 32, 3))
        x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(
            inputs
        )
        x = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(x)
        x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        outputs = keras.layers.Dense(10)(x)
    elif name == "bn_cnn":
        # The CNN above with a BatchNormalization after each convolution.
        inputs = keras.Input((32, 32, 3))
        x = inputs
        for filters, pool in ((32, False), (32, True), (64, False)):
            x = keras.layers.Conv2D(filters, 3, padding="same",
                                    use_bias=False)(x)
            x = keras.layers.BatchNormalization()(x)
            x = keras.layers.Activation("relu")(x)
            if pool:
                x = keras.layers.MaxPooling2D()(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        outputs = keras.layers.Dense(10)(x)
    elif name == "lstm":
        inputs = keras.Input((None,), dtype="int32")
        x = keras.layers.Embedding(1000, 64, mask_zero=True)(inputs)
        x = keras.layers.LSTM(128)(x)
        outputs = keras.layers.Dense(10)(x)
    elif name == "wide_cnn":
        # Activations dominate: 64x64 feature maps with 64 channels.
        inputs = keras.Input((64, 64, 3))
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(
            inputs
        )
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
        x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
        outputs = keras.layers.Dense(10)(x)
    else:
        raise ValueError(f"Unknown model: {name}")
    return model_class(inputs=inputs, outputs=outputs, **kwargs)


def data(name, samples):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, size=samples).astype("int32")
    if name == "mlp":
        return rng.normal(size=(samples, 256)).astype("float32"), y
    if name in ("cnn", "bn_cnn"):
        return rng.random((samples, 32, 32, 3), dtype="float32"), y
    if name == "wide_cnn":
        return rng.random((samples, 64, 64, 3), dtype="float32"), y
    tokens = np.zeros((samples, 40), "int32")
    for i, length in enumerate(rng.integers(5, 41, size=samples)):
        tokens[i, :length] = rng.integers(1, 1000, size=length)
    return tokens, y


def compiled(name, config, n_gradients=N_GRADIENTS):
    """config: "keras" (plain), "accum_model", "accum_model_noise" (with
    measure_noise_scale=True), "keras_accumulation", or "control": an
    AccumulatingModel with n_gradients=1, which runs Keras's own
    train_step, so its ratio to "keras" shows the measurement noise."""
    if config == "control":
        model = build(name, AccumulatingModel, n_gradients=1)
        optimizer = keras.optimizers.Adam(1e-3)
    elif config in ("accum_model", "accum_model_noise"):
        model = build(name, AccumulatingModel, n_gradients=n_gradients,
                      measure_noise_scale=config == "accum_model_noise")
        optimizer = keras.optimizers.Adam(1e-3)
    elif config == "keras_accumulation":
        model = build(name, keras.Model)
        optimizer = keras.optimizers.Adam(
            1e-3, gradient_accumulation_steps=n_gradients
        )
    else:
        model = build(name, keras.Model)
        optimizer = keras.optimizers.Adam(1e-3)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


# Measurements ---------------------------------------------------------------


def seconds_per_micro_batch(model, x, y):
    start = time.perf_counter()
    model.fit(x, y, batch_size=MICRO_BATCH, epochs=1, shuffle=False,
              verbose=0)
    return (time.perf_counter() - start) / (len(x) // MICRO_BATCH)


def interleaved(models, x, y, rounds):
    """Times each model once per round, in rotating order, after a warm-up."""
    for model in models.values():
        seconds_per_micro_batch(model, x, y)  # traces and compiles
    times = {name: [] for name in models}
    names = list(models)
    for round_index in range(rounds):
        order = names[round_index % len(names):] + names[:round_index %
                                                          len(names)]
        for name in order:
            times[name].append(seconds_per_micro_batch(models[name], x, y))
    return times


def summary(values):
    values = np.asarray(values)
    q1, median, q3 = np.percentile(values, [25, 50, 75])
    return {"median": float(median), "q1": float(q1), "q3": float(q3)}


def overhead(model_name, rounds, micro_batches):
    x, y = data(model_name, MICRO_BATCH * micro_batches)
    configs = ("keras", "accum_model", "accum_model_noise",
               "keras_accumulation", "control")
    times = interleaved(
        {c: compiled(model_name, c) for c in configs}, x, y, rounds
    )
    plain = np.asarray(times["keras"])
    return {
        "ms_per_micro_batch": {
            c: summary(1000 * np.asarray(t)) for c, t in times.items()
        },
        # Ratios are paired round by round, so slow phases of the machine
        # affect both sides of a ratio alike.
        "ratio_vs_keras": summary(np.asarray(times["accum_model"]) / plain),
        "noise_ratio_vs_keras": summary(
            np.asarray(times["accum_model_noise"]) / plain),
        "ratio_vs_keras_accumulation": summary(
            np.asarray(times["accum_model"])
            / np.asarray(times["keras_accumulation"])
        ),
        "control_ratio_vs_keras": summary(
            np.asarray(times["control"]) / plain
        ),
    }


def window_cost(rounds, micro_batches=48, n_values=(1, 2, 4, 8, 16)):
    x, y = data("cnn", MICRO_BATCH * micro_batches)
    models = {n: compiled("cnn", "accum_model", n_gradients=n)
              for n in n_values}
    times = interleaved(models, x, y, rounds)
    medians = {n: float(np.median(t)) for n, t in times.items()}
    window = {n: n * medians[n] for n in n_values}
    # window(n) = apply + n * micro_step: a straight line if the cost of an
    # update does not grow with n. The fit gives both; the residual per n
    # is how far each n is from that line.
    slope, intercept = np.polyfit(list(n_values), list(window.values()), 1)
    return {
        str(n): {
            "ms_per_micro_batch": 1000 * medians[n],
            "ms_per_window": 1000 * window[n],
            "ms_apply_estimate": 1000 * (window[n] - slope * n),
        }
        for n in n_values
    } | {"fit": {"ms_per_micro_step": 1000 * slope,
                 "ms_per_update": 1000 * intercept}}


def memory_child(config, steps=6):
    """Runs in a fresh process: trains a few steps, reports peak memory."""
    kind, batch, n = config.split(":")
    batch, n = int(batch), int(n)
    x, y = data("wide_cnn", batch * steps)
    model = compiled("wide_cnn", kind, n_gradients=n)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({
        "peak_mib": peak_kib / 1024,
        "accumulator_mib": getattr(model, "accumulator_bytes", 0) / 2**20,
        "parameter_mib": 4 * model.count_params() / 2**20,
    }))


def memory(large_batch, n):
    micro = large_batch // n
    results = {}
    for label, config in (
        (f"keras, batch {large_batch}", f"keras:{large_batch}:1"),
        (f"keras, batch {micro}", f"keras:{micro}:1"),
        (f"accum_model, batch {micro} x n={n}", f"accum_model:{micro}:{n}"),
    ):
        output = subprocess.run(
            [sys.executable, __file__, "--memory-child", config] + THREADS,
            capture_output=True, text=True, check=True, timeout=900,
        ).stdout
        results[label] = json.loads(output.strip().splitlines()[-1])
    return results


# Report ---------------------------------------------------------------------


# The GPU suite ----------------------------------------------------------------


# On JAX every step is compiled by XLA: no "+jit" row there; on PyTorch
# the accumulating step runs uncompiled (torch.compile is refused).
GPU_PRECISIONS = (("float32", "mixed_float16", "float32+jit")
                  if BACKEND == "tensorflow"
                  else ("float32", "mixed_float16", "mixed_bfloat16"))


def _device_scope(device):
    if BACKEND == "tensorflow":
        return tf.device(device)
    import contextlib

    # JAX and Keras on PyTorch place on their first GPU.
    return contextlib.nullcontext()


def _reset_peak_memory(device):
    if BACKEND == "tensorflow":
        tf.config.experimental.reset_memory_stats(device)
    if BACKEND == "torch":
        torch.cuda.reset_peak_memory_stats()
    # JAX keeps no resettable peak: its figure includes the warm-up, which
    # runs the same configuration.


def _peak_memory_bytes(device):
    if BACKEND == "tensorflow":
        return tf.config.experimental.get_memory_info(device)["peak"]
    if BACKEND == "torch":
        return torch.cuda.max_memory_allocated()
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _compile_options(precision):
    """`compile()`'s arguments for a precision of the GPU suite: each
    backend as its users run it (Keras's default, "auto", compiles JAX's
    step and runs PyTorch's eagerly); "+jit" rows only on TensorFlow."""
    if BACKEND == "tensorflow":
        return {"jit_compile": precision.endswith("+jit")}
    return {}


def _runs_compiled(model):
    """Whether fit() will compile `model`'s step (read after compile())."""
    return model.jit_compile is True and not model.run_eagerly


def gpu_child(config):
    """Fresh process: one configuration of the GPU suite; prints JSON."""
    spec = json.loads(config)
    device = spec["device"]
    precision = spec["precision"]
    keras.mixed_precision.set_global_policy(
        precision if precision.startswith("mixed") else "float32")
    size, batch, n = spec["image_size"], spec["batch"], spec["n_gradients"]
    steps = spec["steps"]
    with _device_scope(device):
        keras.utils.set_random_seed(0)
        rng = np.random.default_rng(0)
        if spec.get("model") == "causal_lm":
            model, x, y = _causal_lm(spec, batch * steps, rng)
        else:
            backbone = keras.applications.ResNet50(
                weights=None, input_shape=(size, size, 3), classes=1000
            )
            model = keras.Model(inputs=backbone.inputs,
                                outputs=backbone.outputs)
            x = rng.random((batch * steps, size, size, 3), dtype="float32")
            y = rng.integers(0, 1000, size=len(x)).astype("int32")
        if n > 1:
            from accum_model import accumulating

            model = accumulating(model, n_gradients=n)
            if spec.get("branched"):
                # The window's end as a conditional, as on a CPU (a GPU
                # selects it; see accum_model.keras3.jax_window).
                model._accumulation.selects_outcomes = False
        model.compile(
            optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(
                from_logits=spec.get("model") == "causal_lm"),
            **_compile_options(precision),
        )
        if BACKEND == "jax" and not _runs_compiled(model):
            sys.exit("the GPU suite's JAX step would run eagerly, op by op; "
                     "compile it as fit() does by default")
        # Warm-up: traces and compiles; not timed.
        warm_up = batch * max(n, 2)
        model.fit(keras.tree.map_structure(lambda a: a[:warm_up], x),
                  y[:warm_up], batch_size=batch, epochs=1, verbose=0)
        on_gpu = device.upper().startswith("GPU")
        if on_gpu:
            _reset_peak_memory(device)
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        seconds = (time.perf_counter() - start) / steps
        peak = _peak_memory_bytes(device) if on_gpu else None
    print(json.dumps({
        "ms_per_micro_batch": 1000 * seconds,
        "peak_mib": None if peak is None else peak / 2**20,
        "accumulator_mib": getattr(model, "accumulator_bytes", 0) / 2**20,
        "parameters": model.count_params(),
        "compiled": _runs_compiled(model),
    }))


def _causal_lm(spec, samples, rng):
    """A keras-hub GPT-2 causal LM built from a config (no download), and
    random token sequences; `spec["lm"]` sizes it (GPT-2 small by default:
    12 layers, width 768, vocabulary 50257, sequences of 512)."""
    import keras_hub

    size = {"vocabulary_size": 50257, "num_layers": 12, "num_heads": 12,
            "hidden_dim": 768, "intermediate_dim": 3072,
            "max_sequence_length": 512, **spec.get("lm", {})}
    backbone = keras_hub.models.GPT2Backbone(dropout=0.0, **size)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone,
                                          preprocessor=None)
    length = size["max_sequence_length"]
    tokens = rng.integers(1, size["vocabulary_size"],
                          size=(samples, length + 1)).astype("int32")
    x = {"token_ids": tokens[:, :-1],
         "padding_mask": np.ones((samples, length), bool)}
    return model, x, tokens[:, 1:]


def gpu_suite(args, device="GPU:0"):
    """Every model x precision x {keras b, keras n*b, accum_model b x n}."""
    n = args.gpu_n_gradients
    steps = 4 * n if args.quick else 16 * n
    results = {}
    micro_batches = {"resnet50": args.gpu_micro_batch,
                     "causal_lm": args.gpu_lm_micro_batch}
    for model_name, precision in [(m, p) for m in args.gpu_models
                                  for p in args.gpu_precisions]:
        micro = micro_batches[model_name]
        rows = [
            (f"keras, batch {micro}", micro, 1, steps, False),
            (f"keras, batch {micro * n}", micro * n, 1, steps // n, False),
            (f"accum_model, batch {micro} x n={n}", micro, n, steps, False),
        ]
        if BACKEND == "jax":
            rows.append((f"accum_model, batch {micro} x n={n}, window end "
                         "branched", micro, n, steps, True))
        for label, batch, n_value, batch_steps, branched in rows:
            spec = {"device": device, "precision": precision,
                    "image_size": args.gpu_image_size, "batch": batch,
                    "n_gradients": n_value, "steps": batch_steps,
                    "model": model_name, "branched": branched}
            key = f"{model_name}, {precision} | {label}"
            output = subprocess.run(
                [sys.executable, __file__, "--backend", BACKEND,
                 "--gpu-child", json.dumps(spec)],
                capture_output=True, text=True, timeout=1800,
            )
            if output.returncode:
                results[key] = {
                    "error": output.stderr.strip().splitlines()[-1][:200]
                }
            else:
                result = json.loads(output.stdout.strip().splitlines()[-1])
                # Per sample, so that b and n*b compare directly.
                result["ms_per_sample"] = result["ms_per_micro_batch"] / batch
                results[key] = result
            print(key, results[key], flush=True)
    return results


def _gpu_machine():
    """The first GPU's name and the stack, or exits saying none is seen."""
    if BACKEND == "jax":
        import jax

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        if not gpus:
            sys.exit("--device gpu: JAX sees no GPU on this machine")
        name = gpus[0].device_kind
    elif BACKEND == "torch":
        if not torch.cuda.is_available():
            sys.exit("--device gpu: PyTorch sees no GPU on this machine")
        name = torch.cuda.get_device_name(0)
    else:
        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            sys.exit("--device gpu: TensorFlow sees no GPU on this machine")
        details = tf.config.experimental.get_device_details(gpus[0])
        name = details.get("device_name", "GPU")
    return f"{name}, {backend_version()}, keras {keras.__version__}"


def gpu_report(results, gpu, command, out):
    lines = [
        "# accum_model GPU benchmark", "",
        f"Machine: {gpu}", f"Command: `{command}`", "",
        "ResNet-50 (weights=None) on synthetic images, and keras-hub's "
        "GPT2CausalLM (GPT-2 small from a config) on random sequences of "
        "512 tokens; SGD with momentum; each row a fresh process; time "
        "after a traced warm-up.", "",
        "| model, precision | configuration | ms per micro-batch | "
        "ms per sample | "
        "peak GPU memory (MiB) | accumulators (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        precision, label = key.split(" | ")
        if "error" in r:
            lines.append(f"| {precision} | {label} | failed: {r['error']} "
                         "| | | |")
            continue
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(
            f"| {precision} | {label} | {r['ms_per_micro_batch']:.1f} | "
            f"{r['ms_per_sample']:.3f} | {peak} | "
            f"{r['accumulator_mib']:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "gpu_results.md"), "w") as f:
        f.write(text)
    write_json(os.path.join(out, "gpu_results.json"),
               {"machine": gpu, "command": command, "results": results})
    print(text)


def report(results, out):
    lines = [
        "# accum_model benchmarks",
        "",
        f"Machine: {results['machine']}",
        f"Command: `{results['command']}`",
        f"Date: {results.get('date', 'not recorded')}",
        "",
        f"## Time per micro-batch (b={MICRO_BATCH}, n_gradients="
        f"{N_GRADIENTS}, Adam)",
        "",
        "Medians over interleaved rounds, [25th, 75th percentile]. "
        "The control is an AccumulatingModel with n_gradients=1, which runs "
        "Keras's own train_step: its ratio to keras is the noise of the "
        "measurement.",
        "",
        "| model | keras (ms) | accum_model (ms) | accum_model, noise scale "
        "on (ms) | keras gradient_accumulation_steps (ms) | "
        "accum_model / keras | noise on / keras | "
        "accum_model / keras accumulation | control / keras |",
        "|---|---|---|---|---|---|---|---|---|",
    ]

    def cell(s, digits=2):
        return (f"{s['median']:.{digits}f} [{s['q1']:.{digits}f}, "
                f"{s['q3']:.{digits}f}]")

    for name, r in results["overhead"].items():
        ms = r["ms_per_micro_batch"]
        noise_ms = ms.get("accum_model_noise")
        noise_ratio = r.get("noise_ratio_vs_keras")
        lines.append(
            f"| {name} | {cell(ms['keras'])} | {cell(ms['accum_model'])} | "
            f"{cell(noise_ms) if noise_ms else '-'} | "
            f"{cell(ms['keras_accumulation'])} | "
            f"{cell(r['ratio_vs_keras'], 3)} | "
            f"{cell(noise_ratio, 3) if noise_ratio else '-'} | "
            f"{cell(r['ratio_vs_keras_accumulation'], 3)} | "
            f"{cell(r['control_ratio_vs_keras'], 3)} |"
        )
    lines += ["", "## Peak memory (wide CNN, 64x64x64 activations, "
              "fresh process each)", "",
              "| configuration | peak RSS (MiB) | accumulators (MiB) |",
              "|---|---|---|"]
    for label, r in results["memory"].items():
        lines.append(f"| {label} | {r['peak_mib']:.0f} | "
                     f"{r['accumulator_mib']:.2f} |")
    # Written in this order by `memory`: plain at the large batch, plain
    # at the micro-batch, accumulating at the micro-batch.
    _, micro_plain, accumulating = results["memory"].values()
    expected = micro_plain["peak_mib"] + accumulating["accumulator_mib"]
    lines += ["", "Plain Keras at the micro-batch plus the accumulators: "
              f"{expected:.0f} MiB; accum_model measured "
              f"{accumulating['peak_mib']:.0f} MiB "
              f"({accumulating['peak_mib'] - expected:+.0f} MiB)."]
    fit = results["window_cost"]["fit"]
    lines += ["", "## Cost of one window against n_gradients (CNN)", "",
              "Medians over rounds; the last column is the straight-line fit "
              "of the window time, window = update + n x micro-batch.", "",
              "| n_gradients | ms per micro-batch | ms per window | "
              "fit (ms) |", "|---|---|---|---|"]
    for n, r in results["window_cost"].items():
        if n == "fit":
            continue
        fitted = fit["ms_per_update"] + int(n) * fit["ms_per_micro_step"]
        lines.append(f"| {n} | {r['ms_per_micro_batch']:.2f} | "
                     f"{r['ms_per_window']:.2f} | {fitted:.2f} |")
    residuals = [
        r["ms_per_window"] - fit["ms_per_update"]
        - int(n) * fit["ms_per_micro_step"]
        for n, r in results["window_cost"].items() if n != "fit"
    ]
    lines += ["", f"Straight-line fit: window = {fit['ms_per_update']:.2f} ms"
              f" + n x {fit['ms_per_micro_step']:.2f} ms; the windows lie "
              f"within {max(abs(r) for r in residuals):.2f} ms of it, so "
              "the update's own cost (the intercept) is known only to about "
              "that.", ""]
    text = "\n".join(lines)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    write_json(os.path.join(out, "results.json"), results)
    print(text)
    plot(results, os.path.join(out, "results.png"))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.6))
    names = list(results["overhead"])
    bars = [("ratio_vs_keras", "accum_model vs keras"),
            ("noise_ratio_vs_keras", "noise scale on vs keras"),
            ("ratio_vs_keras_accumulation",
             "accum_model vs keras gradient_accumulation_steps"),
            ("control_ratio_vs_keras", "control (n_gradients=1) vs keras")]
    bars = [b for b in bars if b[0] in results["overhead"][names[0]]]
    width = 0.8 / len(bars)
    for index, (key, label) in enumerate(bars):
        offset = (index - (len(bars) - 1) / 2) * width
        medians = [results["overhead"][n][key]["median"] for n in names]
        errors = [[m - results["overhead"][n][key]["q1"]
                   for n, m in zip(names, medians)],
                  [results["overhead"][n][key]["q3"] - m
                   for n, m in zip(names, medians)]]
        left.bar(np.arange(len(names)) + offset, medians, width, yerr=errors,
                 label=label)
    left.axhline(1.0, color="black", linewidth=0.8)
    left.set_xticks(range(len(names)), names)
    left.set_ylabel("time ratio (below 1 = faster than plain Keras)")
    left.set_title("time per micro-batch against plain Keras\n"
                   "(median and quartiles; lower is faster)")
    left.set_ylim(0.0, 1.3)  # the whole axis, from zero
    left.legend(fontsize=10, loc="upper center", bbox_to_anchor=(0.5, -0.1),
                ncol=2, frameon=False)
    cost = {int(k): v for k, v in results["window_cost"].items()
            if k != "fit"}
    fit = results["window_cost"]["fit"]
    ns = sorted(cost)
    right.plot(ns, [cost[n]["ms_per_window"] for n in ns], "o",
               label="measured (median)")
    right.plot([0] + ns, [fit["ms_per_update"] + n * fit["ms_per_micro_step"]
                          for n in [0] + ns], "-", linewidth=1,
               label=f"fit: {fit['ms_per_update']:.2f} ms + n x "
                     f"{fit['ms_per_micro_step']:.2f} ms")
    right.set_xlim(0, max(ns) + 1)
    right.set_ylim(0, None)
    right.set_xticks(ns)
    right.set_xlabel("n_gradients (micro-batches per window)")
    right.set_ylabel("time per window (ms, lower is faster)")
    right.set_title("CNN: a window costs its micro-batches")
    right.legend(fontsize=10, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


THREADS = []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--intra-op-threads", type=int, default=1)
    parser.add_argument("--models", nargs="+",
                        default=["mlp", "cnn", "bn_cnn", "lstm"],
                        help="models to time (default: all four)")
    parser.add_argument("--rounds", type=int,
                        help="interleaved timing rounds (default 15)")
    parser.add_argument("--overhead-only", action="store_true",
                        help="skip the memory and window-cost parts")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"),
                        default="tensorflow",
                        help="the Keras 3 backend (read before Keras is "
                             "imported)")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                        help="gpu: the ResNet-50 suite on the first GPU")
    parser.add_argument("--gpu-micro-batch", type=int, default=64)
    parser.add_argument("--gpu-n-gradients", type=int, default=4)
    parser.add_argument("--gpu-image-size", type=int, default=224)
    parser.add_argument("--gpu-lm-micro-batch", type=int, default=8,
                        help="micro-batch of the causal LM (sequences of "
                             "512 tokens)")
    parser.add_argument("--gpu-models", nargs="+",
                        choices=("resnet50", "causal_lm"),
                        default=["resnet50", "causal_lm"])
    parser.add_argument("--gpu-precisions", nargs="+",
                        choices=sorted(set(GPU_PRECISIONS) | {"float32"}),
                        default=list(GPU_PRECISIONS))
    parser.add_argument("--gpu-child", help=argparse.SUPPRESS)
    parser.add_argument("--replot", action="store_true",
                        help="rewrite results.md and results.png from "
                             "results.json, without measuring")
    args = parser.parse_args()
    if args.replot:
        with open(os.path.join(args.out, "results.json")) as f:
            report(json.load(f), args.out)
        return
    if args.gpu_child:
        gpu_child(args.gpu_child)
        return
    if args.backend != "tensorflow" and args.out == DEFAULT_OUT:
        args.out = os.path.join(DEFAULT_OUT, args.backend)
    if args.device == "gpu":
        gpu = _gpu_machine()
        os.makedirs(args.out, exist_ok=True)
        results = gpu_suite(args)
        gpu_report(results, gpu, "python " + " ".join(
            [os.path.relpath(__file__)] + sys.argv[1:]), args.out)
        return
    # One intra-op thread: with TensorFlow's default pools, times on a
    # 2-core machine jump between two modes from one fit() to the next.
    if args.backend == "tensorflow":
        tf.config.threading.set_intra_op_parallelism_threads(
            args.intra_op_threads
        )
        tf.config.threading.set_inter_op_parallelism_threads(1)
    THREADS[:] = ["--intra-op-threads", str(args.intra_op_threads),
                  "--backend", args.backend]
    if args.memory_child:
        memory_child(args.memory_child)
        return
    rounds, micro_batches = (3, 8) if args.quick else (15, 40)
    rounds = args.rounds or rounds
    os.makedirs(args.out, exist_ok=True)
    results = {
        "machine": machine(f"{args.intra_op_threads} intra-op thread(s)"),
        "command": "python " + " ".join(
            [os.path.relpath(__file__)] + sys.argv[1:]
        ),
        "date": datetime.date.today().isoformat(),
        "overhead": {},
    }
    for name in args.models:
        print(f"timing {name} ...", flush=True)
        results["overhead"][name] = overhead(name, rounds, micro_batches)
    if args.overhead_only:
        print(json.dumps(results["overhead"], indent=2))
        return
    print("window cost against n_gradients ...", flush=True)
    results["window_cost"] = window_cost(max(3, rounds // 2))
    print("memory ...", flush=True)
    results["memory"] = memory(large_batch=64 if args.quick else 256, n=8)
    report(results, args.out)


if __name__ == "__main__":
    main()
