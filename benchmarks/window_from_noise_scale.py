"""Fixed windows against the window that sizes itself from the noise scale.

Two small trainings, each to a target validation loss:

* "digits": the CNN of `examples/train_digits.py` on scikit-learn's
  bundled digits (1437 training images), micro-batches of 16, Adam 1e-3;
* "lstm": a masked LSTM on generated token sequences of 5 to 30 tokens
  (is most of a sequence below the vocabulary's middle?), 4096 training
  sequences, micro-batches of 16, Adam 1e-3.

Configurations: fixed windows n in {1, 2, 4, 8, 16} (n = 1 is plain
Keras), and "auto": `WindowFromNoiseScale(min_n_gradients=2,
max_n_gradients=16, learning_rate=...)` from n = 2. Every configuration
uses the same base learning rate. For each configuration and seed it
trains until the validation loss (evaluated after each epoch) reaches the
problem's target, or `--max-epochs`, and records the samples, the
optimizer updates and the wall time (tracing included) it took. Prints a
table of medians with [min, max] over the seeds and writes
`results/window_from_noise_scale.{json,md,png}`.

Run: python benchmarks/window_from_noise_scale.py [--seeds 3]
     [--max-epochs 30] [--rule sqrt]   (about 15 minutes on 2 cores)
"""

import argparse
import functools
import importlib.util
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402
from accum_model import WindowFromNoiseScale  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MICRO_BATCH = 16
FIXED = (1, 2, 4, 8, 16)
# The validation losses each problem trains to: what plain Keras (n = 1)
# reaches in about half of the default epoch budget (digits: epoch 14 of
# 30; lstm: epoch 3), so that larger windows have room to get there.
TARGETS = {"digits": 0.5, "lstm": 0.1}


def digits_example():
    """`examples/train_digits.py`, imported as a module."""
    path = os.path.join(HERE, "..", "examples", "train_digits.py")
    spec = importlib.util.spec_from_file_location("train_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digits_problem():
    example = digits_example()
    train, validation = example.load_data()
    # The ReLU CNN the published figures were measured with.
    return train, validation, functools.partial(example.build_cnn,
                                                activation="relu")


def lstm_problem(samples=4096, length=30, vocabulary=100):
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, length + 1, size=samples + 1024)
    tokens = rng.integers(1, vocabulary, size=(samples + 1024, length))
    tokens[np.arange(length)[None, :] >= lengths[:, None]] = 0
    low = ((tokens > 0) & (tokens < vocabulary // 2)).sum(axis=1)
    labels = (low * 2 > lengths).astype("float32")[:, None]
    tokens = tokens.astype("int32")

    def build(model_class, **kwargs):
        inputs = keras.Input((length,), dtype="int32")
        x = keras.layers.Embedding(vocabulary, 16, mask_zero=True)(inputs)
        x = keras.layers.LSTM(32)(x)
        outputs = keras.layers.Dense(1, activation="sigmoid")(x)
        return model_class(inputs=inputs, outputs=outputs, **kwargs)

    return ((tokens[:samples], labels[:samples]),
            (tokens[samples:], labels[samples:]), build)


PROBLEMS = {"digits": digits_problem, "lstm": lstm_problem}
LOSSES = {"digits": "sparse_categorical_crossentropy",
          "lstm": "binary_crossentropy"}


class _ToTarget(keras.callbacks.Callback):
    """Records each epoch and stops at the target validation loss."""

    def __init__(self, target, samples_per_epoch):
        super().__init__()
        self.target = target
        self.samples_per_epoch = samples_per_epoch
        self.epochs = []

    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append({
            "epoch": epoch + 1,
            "samples": (epoch + 1) * self.samples_per_epoch,
            "updates": int(keras.ops.convert_to_numpy(
                self.model.optimizer.iterations)),
            "seconds": time.perf_counter() - self.start,
            "val_loss": float(logs["val_loss"]),
            "n_gradients": int(getattr(self.model, "n_gradients", 1)),
        })
        if logs["val_loss"] <= self.target:
            self.model.stop_training = True


def run(problem, configuration, seed, max_epochs, rule):
    train, validation, build = PROBLEMS[problem]()
    keras.utils.set_random_seed(seed)
    callbacks = []
    if configuration == 1:
        model = build(keras.Model)
    elif configuration == "auto":
        model = build(AccumulatingModel, n_gradients=2,
                      measure_noise_scale=True)
        callbacks.append(WindowFromNoiseScale(
            min_n_gradients=2, max_n_gradients=16, learning_rate=rule))
    else:
        model = build(AccumulatingModel, n_gradients=configuration)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=LOSSES[problem])
    record = _ToTarget(TARGETS[problem], len(train[0]))
    model.fit(*train, batch_size=MICRO_BATCH, epochs=max_epochs,
              validation_data=validation, shuffle=True, verbose=0,
              callbacks=callbacks + [record])
    reached = record.epochs[-1]["val_loss"] <= TARGETS[problem]
    return {"reached": reached, "epochs": record.epochs}


def summary(values):
    if not values:
        return None
    return {"median": float(np.median(values)), "min": float(min(values)),
            "max": float(max(values))}


def report(results, out):
    lines = [
        "# Fixed windows against `WindowFromNoiseScale`",
        "",
        f"`{results['command']}` ({results['date']}; {results['machine']}).",
        f"Micro-batches of {MICRO_BATCH}, Adam 1e-3 for every "
        f"configuration; \"auto\" starts at n = 2, bounds [2, 16], "
        f"learning-rate rule {results['rule']!r}. Median [min, max] over "
        f"{results['seeds']} seeds of what it took to reach the target "
        "validation loss; \"reached\" counts the seeds that did within "
        f"{results['max_epochs']} epochs (the medians are over those).",
        "",
    ]
    for problem, configurations in results["runs"].items():
        lines += [f"## {problem} (target validation loss "
                  f"{TARGETS[problem]})", "",
                  "| window | reached | samples | updates | seconds | "
                  "final n |", "|---|---|---|---|---|---|"]
        for configuration, runs in configurations.items():
            done = [r["epochs"][-1] for r in runs if r["reached"]]

            def cell(key, digits=0):
                s = summary([e[key] for e in done])
                if s is None:
                    return "-"
                return (f"{s['median']:.{digits}f} [{s['min']:.{digits}f}, "
                        f"{s['max']:.{digits}f}]")

            finals = sorted({r["epochs"][-1]["n_gradients"] for r in runs})
            label = configuration if configuration == "auto" else (
                f"n = {configuration}")
            lines.append(
                f"| {label} | {len(done)}/{len(runs)} | {cell('samples')} "
                f"| {cell('updates')} | {cell('seconds', 1)} | "
                f"{', '.join(str(n) for n in finals)} |")
        lines.append("")
    with open(os.path.join(out, "window_from_noise_scale.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    problems = list(results["runs"])
    figure, axes = plt.subplots(1, len(problems),
                                figsize=(6 * len(problems), 4.2))
    for axis, problem in zip(np.atleast_1d(axes), problems):
        for configuration, runs in results["runs"][problem].items():
            epochs = runs[0]["epochs"]
            axis.plot([e["samples"] for e in epochs],
                      [e["val_loss"] for e in epochs],
                      linewidth=2.5 if configuration == "auto" else 1.2,
                      label=("auto (noise scale)" if configuration == "auto"
                             else f"n = {configuration}"))
        axis.axhline(TARGETS[problem], color="gray", linestyle=":",
                     label="target")
        axis.set_xlabel("training samples")
        axis.set_ylabel("validation loss")
        axis.set_yscale("log")
        axis.set_title(f"{problem} (seed 0; lower is better)")
        axis.legend(fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--rule", default="sqrt",
                        choices=("none", "linear", "sqrt", "adascale"))
    parser.add_argument("--problems", nargs="+", default=list(PROBLEMS))
    parser.add_argument("--out", default=os.path.join(HERE, "results"))
    args = parser.parse_args()
    rule = None if args.rule == "none" else args.rule
    import platform
    import datetime

    results = {
        "command": "python benchmarks/window_from_noise_scale.py "
                   f"--seeds {args.seeds} --max-epochs {args.max_epochs} "
                   f"--rule {args.rule}",
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, keras "
                   f"{keras.__version__} ({keras.backend.backend()})",
        "seeds": args.seeds, "max_epochs": args.max_epochs,
        "rule": rule, "runs": {},
    }
    for problem in args.problems:
        results["runs"][problem] = {}
        for configuration in list(FIXED) + ["auto"]:
            runs = []
            for seed in range(args.seeds):
                runs.append(run(problem, configuration, seed,
                                args.max_epochs, rule))
                last = runs[-1]["epochs"][-1]
                print(problem, configuration, seed, runs[-1]["reached"],
                      last, flush=True)
            results["runs"][problem][str(configuration)
                                     if configuration != "auto"
                                     else "auto"] = runs
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "window_from_noise_scale.json"),
              "w") as f:
        json.dump(results, f, indent=1)
    report(results, args.out)
    plot(results, os.path.join(args.out, "window_from_noise_scale.png"))


if __name__ == "__main__":
    main()
