"""What each `accumulator_dtype` costs in exactness and memory.

Trains the digits CNN of `examples/train_digits.py`, with ReLU
(micro-batches of 16, `n_gradients=4`, Adam), once per accumulator dtype,
and plain Keras on batches of 64 from the same initial weights, and prints
the largest weight difference after each epoch, the accumulators' bytes and
the windows skipped. The last row is plain Keras against itself under XLA: the float32
rounding floor.

Run: python benchmarks/accumulator_dtypes.py [--epochs 5] [--out DIR]
"""

import argparse
import datetime
import os
import pathlib
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent
                       / "examples"))
from train_digits import build_cnn  # noqa: E402
from train_digits import load_data  # noqa: E402
from train_digits import max_weight_difference  # noqa: E402

from accum_model import AccumulatingModel  # noqa: E402
from harness import machine  # noqa: E402
from harness import write_json  # noqa: E402

DTYPES = ("float64", "float32", "bfloat16", "float16")


def _compiled(model, jit_compile=False):
    model.compile(optimizer=keras.optimizers.Adam(1e-2),
                  loss="sparse_categorical_crossentropy",
                  jit_compile=jit_compile)
    return model


def measure(epochs, micro_batch=16, n_gradients=4):
    (x, y), _ = load_data()
    keras.utils.set_random_seed(0)
    initial = build_cnn(keras.Model, "relu").get_weights()

    def fresh(model_class, jit_compile=False, **kwargs):
        model = build_cnn(model_class, "relu", **kwargs)
        model.set_weights(initial)
        return _compiled(model, jit_compile)

    plain, plain_xla = fresh(keras.Model), fresh(keras.Model, True)
    accumulating = {
        dtype: fresh(AccumulatingModel, n_gradients=n_gradients,
                     accumulator_dtype=dtype)
        for dtype in DTYPES
    }
    rows = {dtype: [] for dtype in DTYPES}
    rows["plain Keras under XLA (floor)"] = []
    for _ in range(epochs):
        for model in (plain, plain_xla):
            model.fit(x, y, batch_size=micro_batch * n_gradients, epochs=1,
                      shuffle=False, verbose=0)
        for dtype, model in accumulating.items():
            model.fit(x, y, batch_size=micro_batch, epochs=1, shuffle=False,
                      verbose=0)
            rows[dtype].append(max_weight_difference(model, plain))
        rows["plain Keras under XLA (floor)"].append(
            max_weight_difference(plain_xla, plain)
        )
    table = []
    for name, differences in rows.items():
        model = accumulating.get(name)
        table.append({
            "accumulator_dtype": name,
            "max_weight_difference_by_epoch": differences,
            "accumulator_bytes": model.accumulator_bytes if model else None,
            "skipped_windows": model.skipped_windows if model else None,
        })
    return table


def to_markdown(table, epochs):
    header = " | ".join(f"epoch {e + 1}" for e in range(epochs))
    lines = [
        f"| accumulator_dtype | accumulator bytes | skipped | {header} |",
        "|---|---|---|" + "---|" * epochs,
    ]
    for row in table:
        cells = " | ".join(f"{d:.2e}"
                           for d in row["max_weight_difference_by_epoch"])
        size = row["accumulator_bytes"]
        lines.append(
            f"| {row['accumulator_dtype']} | "
            f"{'' if size is None else size} | "
            f"{'' if row['skipped_windows'] is None else row['skipped_windows']}"
            f" | {cells} |"
        )
    return "\n".join(lines)


def _page(markdown, command):
    return "\n".join([
        "# What each accumulator_dtype costs",
        "",
        f"Command: `{command}`",
        f"Machine: {machine()}",
        f"Date: {datetime.date.today().isoformat()}",
        "",
        "The digits CNN of examples/train_digits.py, micro-batches of 16, "
        "n_gradients=4, Adam 1e-2. Each epoch column: the largest absolute "
        "weight difference from plain Keras with batches of 64 (same "
        "initial weights); accumulator bytes: one replica's accumulators; "
        "skipped: windows skipped for overflow. The last row is plain Keras "
        "under XLA against plain Keras: the float32 rounding floor.",
        "",
        markdown,
    ])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--out", help="folder for the .json and .md results")
    args = parser.parse_args(argv)
    table = measure(args.epochs)
    markdown = to_markdown(table, args.epochs)
    print("max |weight difference| against plain Keras with the large batch")
    print(markdown)
    if args.out:
        out = pathlib.Path(args.out)
        write_json(out / "accumulator_dtypes.json", table)
        (out / "accumulator_dtypes.md").write_text(
            _page(markdown, " ".join(["python", "benchmarks/accumulator_dtypes.py"]
                                     + sys.argv[1:])) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
