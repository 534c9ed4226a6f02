"""What measuring the gradient noise scale costs, and what it reads.

1. Cost: time per micro-batch of `AccumulatingModel(n_gradients=4)` with
   `measure_noise_scale` off and on, for the MLP, CNN and LSTM of
   `run_benchmarks.py` (micro-batches of 32), timed in interleaved rounds;
   the ratio on/off is paired round by round. A second "off" model shows
   the measurement noise (its ratio to the first should be 1).
2. Reading: the digits CNN of `examples/train_digits.py` (micro-batches of
   16, n_gradients=4, Adam 1e-2) with `measure_noise_scale=True`, its
   `noise_scale` per epoch against the window it trains with (n*b = 64).

Writes `noise_scale.md`, `noise_scale.json` and `noise_scale.png` to the
output folder. Not part of the test suite.

Run: python benchmarks/noise_scale.py            (about 6 minutes, 2 cores)
     python benchmarks/noise_scale.py --quick    (a smoke run)
"""

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402
from harness import machine  # noqa: E402
from harness import write_json  # noqa: E402
from run_benchmarks import MICRO_BATCH  # noqa: E402
from run_benchmarks import build  # noqa: E402
from run_benchmarks import data  # noqa: E402
from run_benchmarks import interleaved  # noqa: E402
from run_benchmarks import summary  # noqa: E402
from window_from_noise_scale import digits_example  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def measuring(model_name, measure):
    model = build(model_name, AccumulatingModel, n_gradients=4,
                  measure_noise_scale=measure)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def cost(model_name, rounds, micro_batches):
    x, y = data(model_name, MICRO_BATCH * micro_batches)
    models = {"off": measuring(model_name, False),
              "on": measuring(model_name, True),
              "off_again": measuring(model_name, False)}
    times = interleaved(models, x, y, rounds)
    off = np.asarray(times["off"])
    return {
        "ms_per_micro_batch": {
            name: summary(1000 * np.asarray(t)) for name, t in times.items()
        },
        "ratio_on_vs_off": summary(np.asarray(times["on"]) / off),
        "ratio_off_again_vs_off": summary(np.asarray(times["off_again"])
                                          / off),
    }


def digits_reading(epochs, micro_batch=16, n_gradients=4):
    example = digits_example()
    (x, y), validation = example.load_data()
    keras.utils.set_random_seed(0)
    model = example.build_cnn(AccumulatingModel, "relu",
                              n_gradients=n_gradients,
                              measure_noise_scale=True)
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    history = model.fit(x, y, batch_size=micro_batch, epochs=epochs,
                        validation_data=validation, shuffle=True,
                        verbose=0).history
    return {
        "micro_batch": micro_batch,
        "n_gradients": n_gradients,
        "noise_scale": [float(v) for v in history["noise_scale"]],
        "loss": [float(v) for v in history["loss"]],
        "val_accuracy": [float(v) for v in history["val_accuracy"]],
    }


def report(results, out):
    lines = [
        "# The gradient noise scale: cost and a reading",
        "",
        f"Measured {results['date']} on {results['machine']}, "
        f"TensorFlow {results['tensorflow']}, Keras {results['keras']}.",
        f"Command: `{results['command']}`",
        "",
        "## Cost per micro-batch (n_gradients=4, micro-batches of "
        f"{MICRO_BATCH}, {results['rounds']} interleaved rounds)",
        "",
        "Median ms per micro-batch [quartiles]; ratios paired by round. "
        "\"off, again\" is a second model with measuring off: its ratio to "
        "the first is the measurement noise.",
        "",
        "| model | off (ms) | on (ms) | on / off | off, again / off |",
        "|---|---|---|---|---|",
    ]
    for name, row in results["cost"].items():
        ms = row["ms_per_micro_batch"]
        ratio = row["ratio_on_vs_off"]
        control = row["ratio_off_again_vs_off"]
        lines.append(
            f"| {name} | {ms['off']['median']:.2f} | {ms['on']['median']:.2f}"
            f" | {ratio['median']:.3f} [{ratio['q1']:.3f}, {ratio['q3']:.3f}]"
            f" | {control['median']:.3f} [{control['q1']:.3f}, "
            f"{control['q3']:.3f}] |"
        )
    reading = results["digits"]
    window = reading["micro_batch"] * reading["n_gradients"]
    lines += [
        "",
        "## A reading: the digits CNN of examples/train_digits.py",
        "",
        f"Micro-batches of {reading['micro_batch']}, n_gradients="
        f"{reading['n_gradients']} (a window of {window} samples), Adam "
        "1e-2, shuffled. `noise_scale` is in samples.",
        "",
        "| epoch | noise_scale | loss | val_accuracy |",
        "|---|---|---|---|",
    ]
    for epoch, (noise, loss, accuracy) in enumerate(zip(
            reading["noise_scale"], reading["loss"],
            reading["val_accuracy"]), 1):
        lines.append(f"| {epoch} | {noise:.1f} | {loss:.4f} | "
                     f"{accuracy:.3f} |")
    lines += ["", "![noise scale over epochs](noise_scale.png)", ""]
    with open(os.path.join(out, "noise_scale.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    reading = results["digits"]
    epochs = np.arange(1, len(reading["noise_scale"]) + 1)
    window = reading["micro_batch"] * reading["n_gradients"]
    figure, axes = plt.subplots(figsize=(6, 3.6))
    axes.plot(epochs, reading["noise_scale"], "o-",
              label="measured noise_scale (B_noise)")
    axes.axhline(window, color="gray", linestyle="--",
                 label=f"window n*b = {window}")
    axes.axhline(reading["micro_batch"], color="gray", linestyle=":",
                 label=f"micro-batch b = {reading['micro_batch']}")
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axes.set_yticks([10, 16, 32, 64, 128, 256])
    axes.set_xticks(epochs[::max(1, len(epochs) // 10)])
    axes.set_xlabel("epoch")
    axes.set_ylabel("samples")
    axes.set_title("digits CNN: gradient noise scale per epoch")
    axes.legend(loc="best", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    parser.add_argument("--intra-op-threads", type=int, default=1)
    parser.add_argument("--replot", action="store_true",
                        help="rewrite the table and plot from the JSON")
    args = parser.parse_args()
    json_path = os.path.join(args.out, "noise_scale.json")
    if args.replot:
        with open(json_path) as f:
            results = json.load(f)
        report(results, args.out)
        plot(results, os.path.join(args.out, "noise_scale.png"))
        return
    tf.config.threading.set_intra_op_parallelism_threads(
        args.intra_op_threads
    )
    rounds = 2 if args.quick else args.rounds
    micro_batches = 8 if args.quick else 48
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(f"intra-op threads {args.intra_op_threads}"),
        "command": "python " + " ".join(sys.argv),
        "rounds": rounds,
        "cost": {name: cost(name, rounds, micro_batches)
                 for name in ("mlp", "cnn", "lstm")},
        "digits": digits_reading(2 if args.quick else args.epochs),
    }
    write_json(json_path, results)
    report(results, args.out)
    plot(results, os.path.join(args.out, "noise_scale.png"))


if __name__ == "__main__":
    main()
