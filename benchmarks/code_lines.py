"""Counts the package's code lines: lines inside Python statements, without
docstrings, comments or blank lines, per module and per layer.

    python benchmarks/code_lines.py [--modules]
"""

import ast
import pathlib
import sys

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "accum_model"


def _docstring_lines(tree):
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                             ast.AsyncFunctionDef)):
            body = node.body
            if (body and isinstance(body[0], ast.Expr)
                    and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return lines


def code_lines(path):
    """Int. The code lines of the module at `path`."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            lines.update(range(node.lineno, node.end_lineno + 1))
    source = text.splitlines()
    return sum(1 for number in lines - _docstring_lines(tree)
               if source[number - 1].strip()
               and not source[number - 1].strip().startswith("#"))


def main():
    counts = {path.relative_to(PACKAGE.parent).as_posix(): code_lines(path)
              for path in sorted(PACKAGE.rglob("*.py"))}
    if "--modules" in sys.argv:
        for name, count in counts.items():
            print(f"{count:6d}  {name}")
    layers = {
        "core": lambda name: "/core/" in name,
        "TensorFlow store": lambda name: ("/tensorflow/" in name
                                          or "/keras3/tensorflow_" in name),
        "stateless store": lambda name: "stateless" in name,
    }
    for layer, holds in layers.items():
        print(f"{layer}: {sum(c for n, c in counts.items() if holds(n))}")
    print(f"package: {sum(counts.values())}")
    print("staticmethod re-bindings:", sum(
        path.read_text().count("staticmethod(")
        for path in PACKAGE.rglob("*.py")))


if __name__ == "__main__":
    main()
