"""MultiWorkerMirroredStrategy on two real worker processes on 127.0.0.1.

Most tests run `examples/multi_worker.py`, which starts both workers, kills
and reaps them if they outlive its timeout, and compares their weights with
plain Keras trained in one process on the large batch. The cases of
`multi_worker_cases.py` train in one launch of two workers and are compared
here, each with one device.
"""

import fcntl
import json
import os
import pathlib
import sys

import keras
import numpy as np
import pytest

import helpers
import multi_worker_cases as cases
from helpers import harness

EXAMPLE = (pathlib.Path(__file__).resolve().parent.parent / "examples"
           / "multi_worker.py")
CASES_SCRIPT = pathlib.Path(cases.__file__)


def run_example(*arguments, timeout=300):
    return helpers.run_example(EXAMPLE, *arguments, timeout=timeout)


def test_two_workers_equal_one_process_with_a_short_last_window():
    # 100 samples in global micro-batches of 8: every epoch ends on a
    # window of one 4-sample micro-batch, split 2 + 2 over the workers.
    code, report = run_example("--samples", "100", "--epochs", "3")
    assert code == 0, report
    assert report["replicas"] == 2
    assert report["iterations"] == 12
    assert report["workers_max_difference"] == 0.0
    assert report["vs_single_process_max_difference"] <= 1e-5


def test_worker_failure_ends_in_bounded_time_and_the_window_resumes(
        tmp_path):
    # 13 micro-batches per epoch in windows of 4, carried over epoch ends:
    # each epoch's backup holds a window of one micro-batch, which the
    # restarted workers must resume.
    backup = str(tmp_path / "backup")
    code, report = run_example("--epochs", "3", "--carry-window",
                               "--backup-dir", backup, "--fail-at-epoch", "1")
    assert code == 1
    survivor_code, dead_code = report["exit_codes"]
    assert dead_code == 3
    assert survivor_code != 0
    assert "UnavailableError" in report["outputs"][0]
    # Start-up of both processes included; the survivor stops within
    # seconds of the heartbeat check noticing the dead peer.
    assert report["seconds"] < 150

    code, report = run_example("--epochs", "3", "--carry-window",
                               "--backup-dir", backup)
    assert code == 0, report
    assert report["iterations"] == 10  # ceil(39 / 4)
    assert report["workers_max_difference"] == 0.0
    assert report["vs_single_process_max_difference"] <= 1e-5



@pytest.fixture(scope="module")
def two_worker_cases(tmp_path_factory):
    """The directory where both workers saved every case's results.

    They train once per run: under pytest-xdist the first of its workers to
    get here launches them, in the directory the run's workers share, and
    the others wait for it and read what they saved."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    out = shared / "multi_worker_cases"
    with open(shared / "multi_worker_cases.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "finished").exists():
            out.mkdir(exist_ok=True)
            ports = harness.free_ports(2)
            results = harness.run_bounded([
                [sys.executable, str(CASES_SCRIPT), "--worker-index",
                 str(index), "--ports", *map(str, ports), "--out", str(out)]
                for index in range(2)
            ], timeout=400)
            for code, output in results:
                assert code == 0, output[-4000:]
            (out / "finished").write_text("")
    return out


def _worker_results(out, name):
    weights, reports = [], []
    for index in range(2):
        prefix = out / f"{name}_worker{index}"
        with np.load(str(prefix) + ".npz") as arrays:
            weights.append([arrays[f"arr_{i}"]
                            for i in range(len(arrays.files))])
        reports.append(json.loads(pathlib.Path(str(prefix) + ".json")
                                  .read_text()))
    return weights, reports


def _large_batch_weights(name, policy=None):
    """Plain Keras on one device, one step per window of 32 samples."""
    build, _, learning_rate, _, _, _ = cases.CASES[name]
    x, y = cases.case_data(name)
    keras.mixed_precision.set_global_policy(policy or cases.policy(name))
    try:
        plain = build(keras.Model)
        plain.compile(optimizer=keras.optimizers.SGD(learning_rate),
                      loss=cases.make_loss(name))
        plain.fit(x, y, batch_size=cases.MICRO_BATCH * cases.N_GRADIENTS,
                  epochs=cases.EPOCHS, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    return plain.get_weights(), int(plain.optimizer.iterations.numpy())


def _max_difference(first, second):
    return max(float(np.max(np.abs(a - b))) for a, b in zip(first, second))


@pytest.mark.parametrize("name", [n for n in cases.CASES
                                  if n != "noise_scale"])
def test_two_workers_equal_one_device(two_worker_cases, name):
    (first, second), (report, _) = _worker_results(two_worker_cases, name)
    assert report["replicas"] == 2
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    expected, expected_iterations = _large_batch_weights(name)
    assert report["iterations"] == expected_iterations
    assert all(np.all(np.isfinite(w)) for w in first)
    tolerance = 1e-5
    if cases.policy(name) == "mixed_float16":
        # Read against how far float16 rounding alone moves the large
        # batch (the large batch under float32).
        float32_weights, _ = _large_batch_weights(name, "float32")
        tolerance = 2 * _max_difference(expected, float32_weights) + 1e-6
    assert _max_difference(first, expected) <= tolerance


def _noise_scale_of_the_workers_windows(kernel, bias, x, y):
    """B_noise from each worker's own windows (McCandlish et al.'s
    unbiased estimates), summed over workers and windows, in numpy."""
    residual = x @ kernel + bias - y
    outputs = y.shape[1]
    per_sample = np.concatenate([
        (2.0 / outputs * x[:, :, None] * residual[:, None, :]).reshape(
            len(x), -1),
        2.0 / outputs * residual,
    ], axis=1).astype(np.float64)
    half = cases.MICRO_BATCH // 2
    trace = signal = 0.0
    for worker in range(2):
        micro_batches = cases.worker_rows(len(x), worker).reshape(-1, half)
        for first in range(0, len(micro_batches), cases.N_GRADIENTS):
            window = micro_batches[first:first + cases.N_GRADIENTS]
            means = np.stack([per_sample[rows].mean(0) for rows in window])
            m, total = len(window), half * len(window)
            squared = float(np.sum(half * np.sum(means ** 2, axis=1)))
            window_term = float(np.sum((half * means).sum(0) ** 2)) / total
            trace += (squared - window_term) / (m - 1)
            signal += (window_term - squared / m) * m / (total * (m - 1))
    return max(trace, 0.0) / signal


def test_two_workers_measure_the_noise_scale_of_their_windows(
        two_worker_cases):
    (first, second), (report, _) = _worker_results(two_worker_cases,
                                                   "noise_scale")
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    x, y = cases.case_data("noise_scale")
    expected = _noise_scale_of_the_workers_windows(*first, x, y)
    logged = report["history"]["noise_scale"]
    assert len(logged) == cases.EPOCHS
    np.testing.assert_allclose(logged, expected, rtol=1e-3)


def test_two_workers_reduce_once_per_window(two_worker_cases):
    # Each worker's traced step (SGD with clipnorm): no collective per
    # micro step, one per window.
    for index in range(2):
        counts = json.loads((two_worker_cases
                             / f"collectives_worker{index}.json").read_text())
        assert counts == {"every_step": 0, "conditional": 1}
