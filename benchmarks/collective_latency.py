"""What one cross-worker all-reduce costs on loopback, in plain TensorFlow.

Two `MultiWorkerMirroredStrategy` workers on 127.0.0.1 (no Keras, no
accum_model) each run a `tf.function` step that all-reduces one float32
tensor, for tensor sizes from 4 bytes to 16.8 MB (the gradient of
`multi_worker_bandwidth.py`'s model), optionally after a matrix product
that keeps the worker's core busy as a training step would. Each step is
timed on worker 0; the script prints the median, the 10th and 90th
percentiles, and the sorted times in sevenths, so that a latency that comes
in quanta (a timer, delayed acknowledgements) would show as steps.

Run: python benchmarks/collective_latency.py [--steps 40] [--compute-rows 0]
         [--pin]   # each worker on one core, as multi_worker_bandwidth.py
         [--scalars-after 3]   # then scalar reductions, as fit()'s logs
"""

import argparse
import json
import os
import subprocess
import sys
import time

from harness import free_ports

SIZES = (1, 1_000, 100_000, 1_000_000, 4_200_000)  # float32 elements


def run_worker(args):
    os.environ["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in args.ports]},
        "task": {"type": "worker", "index": args.worker_index},
    })
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    if args.pin:
        tf.config.threading.set_inter_op_parallelism_threads(2)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    weight = tf.random.normal([2048, 2048])
    rows = tf.random.normal([max(args.compute_rows, 1), 2048])
    times = {}
    for size in SIZES:
        value = tf.ones([size])

        @tf.function
        def step():
            def replica():
                total = tf.constant(0.0)
                if args.compute_rows:
                    hidden = rows
                    for _ in range(3):
                        hidden = tf.matmul(hidden, weight) * 1e-3
                    total = tf.reduce_sum(hidden) * 0.0
                context = tf.distribute.get_replica_context()
                result = context.all_reduce("SUM", value + total)
                # Scalars reduced after it, each depending on the one
                # before, as Keras's fit() reduces its logs after a step.
                scalar = tf.reduce_sum(result[:1])
                for _ in range(args.scalars_after):
                    scalar = context.all_reduce("SUM", scalar * 0.5)
                return result[:1] + scalar * 0.0

            return strategy.run(replica)

        for _ in range(3):  # traces, and lets both workers line up
            step()
        elapsed = []
        for _ in range(args.steps):
            start = time.perf_counter()
            result = step()
            strategy.experimental_local_results(result)[0].numpy()
            elapsed.append(1000 * (time.perf_counter() - start))
        times[size] = elapsed
    if args.worker_index == 0:
        print(json.dumps(times))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--compute-rows", type=int, default=0,
                        help="rows of the matrix product before each "
                             "all-reduce (0: none)")
    parser.add_argument("--scalars-after", type=int, default=0,
                        help="scalar all-reduces after the tensor's, in "
                             "the same step (0: none)")
    parser.add_argument("--pin", action="store_true",
                        help="run each worker on one core of its own "
                             "(taskset), as multi_worker_bandwidth.py does")
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ports", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_index is not None:
        run_worker(args)
        return
    import numpy as np

    ports = free_ports(2)
    commands = [
        (["taskset", "-c", str(i % os.cpu_count())] if args.pin else [])
        + [sys.executable, os.path.abspath(__file__), "--worker-index", str(i),
           "--ports", *map(str, ports), "--steps", str(args.steps),
           "--compute-rows", str(args.compute_rows),
           "--scalars-after", str(args.scalars_after)]
        + (["--pin"] if args.pin else [])
        for i in range(2)
    ]
    workers = [subprocess.Popen(c, stdout=subprocess.PIPE, text=True)
               for c in commands]
    outputs = [w.communicate(timeout=900)[0] for w in workers]
    times = json.loads(outputs[0].strip().splitlines()[-1])
    print(f"two workers on 127.0.0.1, {args.steps} steps, compute rows "
          f"{args.compute_rows}, {args.scalars_after} scalar reductions "
          f"after, {'one core each' if args.pin else 'unpinned'}"
          "; ms per step")
    print("| bytes | median | p10 | p90 | sorted, every 7th |")
    print("|---|---|---|---|---|")
    for size, elapsed in times.items():
        elapsed = np.sort(np.asarray(elapsed))
        p10, median, p90 = np.percentile(elapsed, [10, 50, 90])
        sample = ", ".join(f"{t:.1f}" for t in elapsed[::7])
        print(f"| {4 * int(size)} | {median:.2f} | {p10:.2f} | {p90:.2f} "
              f"| {sample} |")


if __name__ == "__main__":
    main()
