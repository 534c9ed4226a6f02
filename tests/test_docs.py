"""Every Python block of README.md and docs/ runs, so the docs cannot rot.

A page's blocks run in order, in one fresh process per page. README.md's
blocks run exactly as written. A page of docs/ starts from `DOCS_PRELUDE`:
the names its fragments take for granted (`keras`, `tf`, `np`,
`AccumulatingModel`, `accumulating`, small `x`/`y` data, an `inputs` /
`outputs` graph and `build_model()`). A block that cannot run here starts
with `# not run:` and the reason.
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
NOT_RUN = "# not run:"

DOCS_PRELUDE = '''
import keras
import numpy as np
import tensorflow as tf

from accum_model import AccumulatingModel
from accum_model import accumulating

rng = np.random.default_rng(0)
x = rng.normal(size=(64, 6)).astype("float32")
y = rng.normal(size=(64, 1)).astype("float32")
inputs = keras.Input((6,))
outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(inputs))


def build_model(n_gradients=4):
    model_inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(model_inputs)
    return AccumulatingModel(inputs=model_inputs,
                             outputs=keras.layers.Dense(1)(hidden),
                             n_gradients=n_gradients)
'''


def python_blocks(page):
    return re.findall(r"^```python\n(.*?)^```", page.read_text(),
                      re.S | re.M)


def test_every_page_is_found_and_has_blocks_to_run():
    names = {page.name for page in PAGES}
    assert {"README.md", "exactness.md", "api.md", "mixed-precision.md",
            "distribution.md", "checkpoints.md", "keras2.md",
            "custom-train-step.md", "keras-hub.md", "compatibility.md",
            "performance.md"} <= names
    assert python_blocks(ROOT / "README.md")


def test_blocks_not_run_say_why():
    for page in PAGES:
        for block in python_blocks(page):
            first = block.splitlines()[0]
            if first.startswith(NOT_RUN):
                assert first[len(NOT_RUN):].strip(), (
                    f"{page.name}: a block marked not run gives no reason"
                )


@pytest.mark.parametrize(
    "page", [p for p in PAGES[1:] if python_blocks(p)], ids=lambda p: p.name
)
def test_page_blocks_run(page, tmp_path):
    blocks = [b for b in python_blocks(page)
              if not b.startswith(NOT_RUN)]
    if not blocks:
        pytest.skip("every block is marked not run")
    code = "\n".join(blocks)
    if "keras_hub" in code:
        pytest.importorskip("keras_hub")
    if page.parent.name == "docs":
        code = DOCS_PRELUDE + "\n" + code
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
        text=True, timeout=600,
    )
    assert result.returncode == 0, (
        f"{page.name}'s code blocks failed:\n{result.stderr[-3000:]}"
    )


def _readme_blocks():
    """README's Python blocks, each with the text block shown after it."""
    return re.findall(r"^```python\n(.*?)^```\n(?:\n```text\n(.*?)^```)?",
                      (ROOT / "README.md").read_text(), re.S | re.M)


@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_each_readme_block_runs_alone_and_prints_what_it_shows(index,
                                                               tmp_path):
    code, shown = _readme_blocks()[index]
    assert shown, "a README block shows nothing of what it prints"
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
        text=True, timeout=600,
    )
    assert result.returncode == 0, (
        f"README block {index} failed alone:\n{result.stderr[-3000:]}")
    printed = result.stdout.splitlines()
    assert len(printed) == len(shown.splitlines()), printed
    for line, out in zip(shown.splitlines(), printed):
        label, _, value = line.rpartition(": ")
        if "difference" in label:
            # A weight difference is float32 rounding, not a fixed number.
            assert out.startswith(label + ": "), (line, out)
            assert float(out.rpartition(": ")[2]) <= 1e-6, (line, out)
        else:
            assert out == line


def test_the_changelog_opens_with_the_packages_version():
    import accum_model

    versions = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(),
                          re.M)
    assert versions and versions[0] == accum_model.__version__
