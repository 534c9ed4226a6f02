"""The package's layers, read from its imports: each floor imports only
downward, with no circle.

    core (no backend, no Keras)  <  tensorflow (the TensorFlow window, no
    Keras)  <  keras3 / keras2 adapters  <  _chooser  <  the model (no
    backend)

Read with `ast`, so these tests need neither TensorFlow, JAX nor Keras.
"""

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "accum_model"
ADAPTERS = ("accum_model.keras3", "accum_model.keras2")
# The window on TensorFlow, shared by the two adapters on TensorFlow.
TENSORFLOW_WINDOW = "accum_model.tensorflow"
CHOOSER = "accum_model._chooser"
# The modules the chooser stands on (the stack check, the version).
CHOOSER_FLOOR = ("accum_model._stack", "accum_model._version")
KERAS_PACKAGES = ("keras", "tf_keras")
BACKEND_PACKAGES = ("tensorflow", "jax", "jaxlib", "torch")


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
    if _within(module, TENSORFLOW_WINDOW):
        return 1
    if any(_within(module, adapter) for adapter in ADAPTERS):
        return 2
    if module == CHOOSER or module in CHOOSER_FLOOR:
        return 3
    return 4


def _package_imports(module):
    return [name for name, top in _imports(module) if _ours(name) and top]


def test_the_package_has_each_floor():
    floors = {_floor(module) for module in MODULES}
    assert floors == {0, 1, 2, 3, 4}
    assert {"accum_model.core.arithmetic", "accum_model.accumulating_model",
            "accum_model.tensorflow.accumulation", *ADAPTERS,
            CHOOSER} <= set(MODULES)


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
def test_an_adapter_never_imports_another(adapter):
    others = [a for a in ADAPTERS if a != adapter]
    for module in MODULES:
        if _within(module, adapter):
            for name in _package_imports(module):
                assert not any(_within(name, other) for other in others), (
                    f"{module} imports {name}")


def _imports_of_packages(module, packages):
    return [name for name, _ in _imports(module)
            if name.split(".")[0] in packages]


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if _within(m, "accum_model.core"))
)
def test_the_core_imports_no_keras_and_no_backend(module):
    found = _imports_of_packages(module, KERAS_PACKAGES + BACKEND_PACKAGES)
    assert not found, f"{module} imports {found}"


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if _within(m, TENSORFLOW_WINDOW))
)
def test_the_tensorflow_window_imports_no_keras(module):
    found = _imports_of_packages(module, KERAS_PACKAGES)
    assert not found, f"{module} imports {found}"


@pytest.mark.parametrize(
    "module", sorted(m for m in MODULES if _floor(m) == 4)
)
def test_the_model_layer_imports_no_backend(module):
    # Backends differ in the adapters only: the public model, its checks
    # and its callbacks import no backend, nor the TensorFlow window.
    found = _imports_of_packages(module, BACKEND_PACKAGES + ("tf_keras",))
    found += [name for name in _package_imports(module)
              if _within(name, TENSORFLOW_WINDOW)]
    assert not found, f"{module} imports {found}"


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
    """Names a module defines at its top level, in both arms of a top-level
    `if` too (an adapter picks its backend's modules so)."""
    tree = ast.parse(MODULES[module].read_text())
    names = set()
    body = list(tree.body)
    for node in tree.body:
        if isinstance(node, ast.If):
            body += node.body + node.orelse
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {getattr(t, "id", None) for t in node.targets}
    return names


def test_adapters_offer_the_same_names():
    offered = [_all_of(adapter) for adapter in ADAPTERS]
    assert None not in offered
    for names in offered[1:]:
        assert sorted(names) == sorted(offered[0])
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
