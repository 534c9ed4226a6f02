"""The package's layers, read from its imports: each floor imports only
downward, with no circle.

    core (no backend, no Keras)  <  tensorflow (the TensorFlow window, no
    Keras)  <  keras3 / keras2 adapters  <  _chooser  <  the model (no
    backend)

The model layer asks one `Adapter` (core/adapter.py); each Keras and
backend's subclass answers all of it.

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


def _classes():
    """Every class the package defines: name -> [(module, base names,
    names defined in its body)]."""
    found = {}
    for module in MODULES:
        for node in ast.parse(MODULES[module].read_text()).body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [getattr(b, "id", getattr(b, "attr", None))
                     for b in node.bases]
            names = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, ast.Assign):
                    names |= {getattr(t, "id", None) for t in item.targets}
            found.setdefault(node.name, []).append((module, bases, names))
    return found


def test_no_class_name_is_defined_in_two_modules():
    twice = {name: [module for module, _, _ in places]
             for name, places in _classes().items() if len(places) > 1}
    assert not twice, twice


def _chosen_adapters():
    """The adapter classes `_chooser` picks from."""
    return sorted(alias.name
                  for node in ast.walk(ast.parse(MODULES[CHOOSER].read_text()))
                  if isinstance(node, ast.ImportFrom)
                  for alias in node.names if alias.asname == "Adapter")


def _asked_of(variable, modules):
    """Attributes read from the name `variable` in `modules`."""
    return {node.attr for module in modules
            for node in ast.walk(ast.parse(MODULES[module].read_text()))
            if isinstance(node, ast.Attribute)
            and getattr(node.value, "id", None) == variable}


def _offered_by(class_name):
    classes = _classes()
    offered, pending = set(), [class_name]
    while pending:
        for _, bases, names in classes.get(pending.pop(), []):
            offered |= names
            pending += bases
    return offered


def test_the_chooser_picks_one_adapter_per_keras_and_backend():
    assert _chosen_adapters() == sorted(
        ["JaxAdapter", "Keras2Adapter", "TensorFlowAdapter", "TorchAdapter"])


@pytest.mark.parametrize("adapter_class", _chosen_adapters())
def test_each_adapter_answers_what_the_layers_above_ask(adapter_class):
    asked = _asked_of("adapter", [m for m in MODULES if _floor(m) >= 3])
    if adapter_class in ("TensorFlowAdapter", "Keras2Adapter"):
        asked |= _asked_of("adapter", ["accum_model.tensorflow.train_step"])
    missing = asked - _offered_by(adapter_class)
    assert not missing, f"{adapter_class} lacks {sorted(missing)}"


def _declared_parts():
    """`Adapter.PARTS`, read from core/adapter.py."""
    tree = ast.parse(MODULES["accum_model.core.adapter"].read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign)
                and getattr(node.targets[0], "id", None) == "PARTS"):
            return ast.literal_eval(node.value)
    raise AssertionError("core/adapter.py declares no PARTS")


def _part_modules(class_name):
    """Each part an adapter class (or a base of it) sets, by the module it
    names: `losses = losses` after `from accum_model.keras3 import losses`."""
    found = {}
    pending = [class_name]
    while pending:
        name = pending.pop()
        for module, bases, _ in _classes().get(name, []):
            tree = ast.parse(MODULES[module].read_text())
            imported = {alias.asname or alias.name:
                        f"{node.module}.{alias.name}"
                        for node in tree.body
                        if isinstance(node, ast.ImportFrom) and node.module
                        for alias in node.names}
            body = next(node.body for node in tree.body
                        if isinstance(node, ast.ClassDef)
                        and node.name == name)
            for item in body:
                if (isinstance(item, ast.Assign)
                        and isinstance(item.value, ast.Name)
                        and getattr(item.targets[0], "id", None)
                        == item.value.id and item.value.id in imported):
                    found.setdefault(item.value.id, imported[item.value.id])
            pending += bases
    return found


def _top_level_names(module):
    names = set()
    for node in ast.parse(MODULES[module].read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {getattr(t, "id", None) for t in node.targets}
    return names


@pytest.mark.parametrize("adapter_class", _chosen_adapters())
def test_each_adapters_parts_hold_what_the_layers_above_call(adapter_class):
    parts = _declared_parts()
    modules = _part_modules(adapter_class)
    assert set(parts) <= set(modules), (
        f"{adapter_class} sets no part {sorted(set(parts) - set(modules))}")
    for part, names in parts.items():
        missing = set(names) - _top_level_names(modules[part])
        assert not missing, f"{modules[part]} lacks {sorted(missing)}"
    # And the layers above call nothing of a part that `PARTS` does not
    # name.
    for module in MODULES:
        for node in ast.walk(ast.parse(MODULES[module].read_text())):
            if (isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Attribute)
                    and getattr(node.value.value, "id", None) == "adapter"
                    and node.value.attr in parts):
                assert node.attr in parts[node.value.attr], (
                    f"{module} calls adapter.{node.value.attr}.{node.attr}, "
                    "which Adapter.PARTS does not name")
