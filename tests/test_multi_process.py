"""`keras.distribution.DataParallel` over two JAX processes on 127.0.0.1.

Runs `examples/jax_processes.py`, which starts both processes (one CPU
device each, `keras.distribution.initialize`), stops both if one dies or
they outlive its timeout, and compares their weights with plain Keras
trained in one process on the large batch.
"""

import pathlib

import pytest

import helpers
from backends import jax_only

EXAMPLE = (pathlib.Path(__file__).resolve().parent.parent / "examples"
           / "jax_processes.py")

pytestmark = [jax_only("jax.distributed"), pytest.mark.distributed]


def run_example(*arguments, timeout=300):
    return helpers.run_example(EXAMPLE, *arguments, timeout=timeout)


def test_a_process_that_dies_mid_window_resumes_exactly(tmp_path):
    # 100 samples in global micro-batches of 8 (the last 4, split 2 + 2),
    # 13 per epoch in windows of 4 carried over epoch ends: the backup of
    # each epoch holds an open window of one micro-batch, which the
    # restarted processes must resume.
    backup = str(tmp_path / "backup")
    code, report = run_example("--epochs", "3", "--carry-window",
                               "--backup-dir", backup, "--fail-at-epoch", "1")
    assert code == 1
    survivor_code, dead_code = report["exit_codes"]
    assert dead_code == 3
    assert survivor_code != 0

    code, report = run_example("--epochs", "3", "--carry-window",
                               "--backup-dir", backup)
    assert code == 0, report
    # Each process has the devices the suite gives it (two on the CPU).
    assert report["processes"] == 2 and report["devices"] >= 2
    assert report["iterations"] == 10  # ceil(39 / 4)
    assert report["processes_max_difference"] == 0.0
    assert report["vs_single_process_max_difference"] <= 1e-5
