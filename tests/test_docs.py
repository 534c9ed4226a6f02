"""Every Python block of README.md and docs/ runs, so the docs cannot rot.

A block runs as a user copies it, in a fresh process: on its own, or,
where its first line says `# continues from the block above`, after the
blocks of its page it continues from. README.md's blocks each run alone and
print what the page shows. A block that cannot run here starts with
`# not run:` and the reason.
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
NOT_RUN = "# not run:"
CONTINUES = "# continues from the block above"


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


def runs(page):
    """The page's runnable blocks as runs: each a block that starts fresh,
    with the blocks that continue from it."""
    chains = []
    for block in python_blocks(page):
        if block.startswith(NOT_RUN):
            continue
        if block.startswith(CONTINUES):
            assert chains, f"{page.name}: a block continues from nothing"
            chains[-1].append(block)
        else:
            chains.append([block])
    return chains


@pytest.mark.parametrize(
    "page", [p for p in PAGES[1:] if runs(p)], ids=lambda p: p.name
)
def test_page_blocks_run(page, tmp_path):
    for chain in runs(page):
        code = "\n".join(chain)
        if "keras_hub" in code:
            pytest.importorskip("keras_hub")
        result = subprocess.run(
            [sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
            text=True, timeout=600,
        )
        assert result.returncode == 0, (
            f"{page.name}'s block failed as it stands:\n"
            f"{chain[0][:300]}\n{result.stderr[-3000:]}"
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
