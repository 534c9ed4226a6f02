"""MultiWorkerMirroredStrategy on two real worker processes on 127.0.0.1.

Each test runs `examples/multi_worker.py`, which starts both workers, kills
and reaps them if they outlive its timeout, and compares their weights with
plain Keras trained in one process on the large batch.
"""

import json
import pathlib
import subprocess
import sys

EXAMPLE = (pathlib.Path(__file__).resolve().parent.parent / "examples"
           / "multi_worker.py")


def run_example(*arguments, timeout=300):
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--json", "--timeout", str(timeout),
         *arguments],
        capture_output=True, text=True, timeout=timeout + 120,
    )
    lines = [line for line in result.stdout.splitlines()
             if line.startswith("{")]
    assert lines, result.stdout[-3000:] + result.stderr[-3000:]
    return result.returncode, json.loads(lines[-1])


def test_two_workers_equal_one_process_with_a_short_last_window():
    # 100 samples in global micro-batches of 8: every epoch ends on a
    # window of one 4-sample micro-batch, split 2 + 2 over the workers.
    code, report = run_example("--samples", "100", "--epochs", "3")
    assert code == 0, report
    assert report["replicas"] == 2
    assert report["iterations"] == 12
    assert report["workers_max_difference"] == 0.0
    assert report["vs_single_process_max_difference"] <= 1e-5


def test_two_workers_under_mixed_precision():
    code, report = run_example("--samples", "90", "--epochs", "3",
                               "--mixed-precision")
    assert code == 0, report
    assert report["iterations"] == 9
    assert report["workers_max_difference"] == 0.0
    assert (report["vs_single_process_max_difference"]
            <= 2 * report["float16_rounding_max_difference"] + 1e-6)


def test_worker_failure_ends_in_bounded_time_and_backup_resumes(tmp_path):
    backup = str(tmp_path / "backup")
    code, report = run_example("--epochs", "3", "--backup-dir", backup,
                               "--fail-at-epoch", "1")
    assert code == 1
    survivor_code, dead_code = report["exit_codes"]
    assert dead_code == 3
    assert survivor_code != 0
    assert "UnavailableError" in report["outputs"][0]
    # Start-up of both processes included; the survivor stops within
    # seconds of the heartbeat check noticing the dead peer.
    assert report["seconds"] < 150

    code, report = run_example("--epochs", "3", "--backup-dir", backup)
    assert code == 0, report
    assert report["iterations"] == 12
    assert report["workers_max_difference"] == 0.0
    assert report["vs_single_process_max_difference"] <= 1e-5


def test_window_carried_over_an_epoch_survives_a_worker_failure(tmp_path):
    # 13 micro-batches per epoch in windows of 4: each epoch's backup holds
    # a window of one micro-batch, which the restarted workers must resume.
    backup = str(tmp_path / "backup")
    code, report = run_example("--epochs", "3", "--carry-window",
                               "--backup-dir", backup, "--fail-at-epoch", "1")
    assert code == 1 and report["exit_codes"][1] == 3

    code, report = run_example("--epochs", "3", "--carry-window",
                               "--backup-dir", backup)
    assert code == 0, report
    assert report["iterations"] == 10  # ceil(39 / 4)
    assert report["workers_max_difference"] == 0.0
    assert report["vs_single_process_max_difference"] <= 1e-5
