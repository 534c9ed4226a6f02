"""The examples run end to end, as a user runs them."""

import pathlib
import re
import subprocess
import sys

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def test_digits_example_matches_the_large_batch():
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "train_digits.py"), "--epochs", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    updates = re.findall(r"epoch \d: (\d+) optimizer updates", result.stdout)
    # 1437 training images: 90 micro-batches of 16 (the last of 13), so 23
    # windows an epoch, as many as batches of 64.
    assert updates == ["23"] * 4
    difference = float(
        re.search(r"accumulated vs large batch: (\S+)", result.stdout).group(1)
    )
    assert difference <= 1e-5
