"""The package's layers, read from its imports: each floor imports only
downward, with no circle.

    core (no Keras)  <  keras3 / keras2 adapters  <  _chooser  <  the model

Read with `ast`, so these tests need neither TensorFlow nor Keras.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "accum_model"
ADAPTERS = ("accum_model.keras3", "accum_model.keras2")
CHOOSER = "accum_model._chooser"
# The modules the chooser stands on (the stack check, the version).
CHOOSER_FLOOR = ("accum_model._stack", "accum_model._version")
KERAS_PACKAGES = ("keras", "tf_keras")


def _module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


MODULES = {
    _module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))
}


def _resolve(node, module):
    """The modules an import statement names (package submodules resolved)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".")
        if MODULES[module].name != "__init__.py":
            package = package[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join(package + ([base] if base else []))
    names = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}"
        names.append(candidate if candidate in MODULES else base)
    return names


def _imports(module):
    """(imported module, at module level?) for every import in `module`."""
    tree = ast.parse(MODULES[module].read_text())
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(
                    (name, not in_function) for name in _resolve(child, module)
                )
            visit(child, in_function or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            ))

    visit(tree, False)
    return found


def _ours(name):
    return name == "accum_model" or name.startswith("accum_model.")


def _within(name, package):
    return name == package or name.startswith(package + ".")


def _floor(module):
    if _within(module, "accum_model.core"):
        return 0
    if any(_within(module, adapter) for adapter in ADAPTERS):
        return 1
    if module == CHOOSER or module in CHOOSER_FLOOR:
        return 2
    return 3


def _package_imports(module):
    return [name for name, top in _imports(module) if _ours(name) and top]


def test_the_package_has_each_floor():
    floors = {_floor(module) for module in MODULES}
    assert floors == {0, 1, 2, 3}
    assert {"accum_model.core.accumulation", "accum_model.accumulating_model",
            *ADAPTERS, CHOOSER} <= set(MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_run_only_downward(module):
    for name in _package_imports(module):
        if name == "accum_model":
            assert module == "accum_model", f"{module} imports the package"
            continue
        assert _floor(name) <= _floor(module), (
            f"{module} (floor {_floor(module)}) imports {name} "
            f"(floor {_floor(name)})"
        )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_function_level_import_of_a_package_module(module):
    late = [name for name, top in _imports(module) if _ours(name) and not top]
    assert not late, f"{module} imports {late} inside a function"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_only_the_chooser_imports_an_adapter(module):
    for name in _package_imports(module):
        for adapter in ADAPTERS:
            if _within(name, adapter) and not _within(module, adapter):
                assert module == CHOOSER, f"{module} imports {name}"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_an_adapter_never_imports_the_other(adapter):
    other = next(a for a in ADAPTERS if a != adapter)
    for module in MODULES:
        if _within(module, adapter):
            for name in _package_imports(module):
                assert not _within(name, other), f"{module} imports {name}"


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if _within(m, "accum_model.core"))
)
def test_the_core_imports_no_keras(module):
    keras_imports = [
        name for name, _ in _imports(module)
        if name.split(".")[0] in KERAS_PACKAGES
    ]
    assert not keras_imports, f"{module} imports {keras_imports}"


def test_the_keras2_adapter_never_imports_keras_by_name():
    # In a tf_keras process `import keras` would load Keras 3.
    for module in MODULES:
        if _within(module, "accum_model.keras2"):
            named = [name for name, _ in _imports(module)
                     if name.split(".")[0] in KERAS_PACKAGES]
            assert not named, f"{module} imports {named}"


def test_no_import_circle():
    graph = {module: set(_package_imports(module)) & set(MODULES)
             for module in MODULES}
    done, path = set(), []

    def visit(module):
        if module in path:
            circle = path[path.index(module):] + [module]
            pytest.fail("import circle: " + " -> ".join(circle))
        if module in done:
            return
        path.append(module)
        for name in sorted(graph[module]):
            visit(name)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def _all_of(module):
    tree = ast.parse(MODULES[module].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(target, "id", None) == "__all__" for target in node.targets
        ):
            return ast.literal_eval(node.value)
    return None


def _top_level_names(module):
    tree = ast.parse(MODULES[module].read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {getattr(t, "id", None) for t in node.targets}
    return names


def test_adapters_offer_the_same_names():
    keras3, keras2 = (_all_of(adapter) for adapter in ADAPTERS)
    assert keras3 is not None and keras2 is not None
    assert sorted(keras3) == sorted(keras2)
    for adapter in ADAPTERS:
        missing = set(_all_of(adapter)) - _top_level_names(adapter)
        assert not missing, f"{adapter} lists {missing} without defining them"


@pytest.mark.parametrize("adapter", ADAPTERS)
def test_each_adapter_module_lists_what_it_offers(adapter):
    offered = set(_all_of(adapter))
    listed = set()
    for module in MODULES:
        if _within(module, adapter) and module != adapter:
            listed |= set(_all_of(module) or [])
    assert offered - {"keras"} == listed, (
        f"{adapter}'s __all__ and its modules' differ: "
        f"{sorted(offered.symmetric_difference(listed))}"
    )
