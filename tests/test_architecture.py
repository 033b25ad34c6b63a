"""The package's shape (docs/ARCHITECTURE.md): no import cycle, no module reaching for another's
underscore names (bench scripts included), no arrow from the passes or the frontends up to the
modules above them, no file over 800 lines nor function over 80, and the hooks (the recurrent
forms among them) declared by the methods."""

from __future__ import annotations

import ast
import types
from pathlib import Path

import networkx as nx
import pytest

from attnrewrite import passes
from attnrewrite.passes import hooks

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "attnrewrite"
MAX_LINES = 800
MAX_FUNCTION_LINES = 80  # a function longer than a screen does several jobs
# what each layer may import from the package, besides itself (docs/ARCHITECTURE.md)
BELOW_PASSES = {"attnrewrite.site", "attnrewrite.errors"}
BELOW_FRONTENDS = BELOW_PASSES | {
    "attnrewrite.passes",
    "attnrewrite.record",
    "attnrewrite.data",
    "attnrewrite.decision",
}
LAYERS = {
    "attnrewrite.passes": BELOW_PASSES,
    "attnrewrite.onnx": BELOW_FRONTENDS,
    "attnrewrite.fx": BELOW_FRONTENDS,
    "attnrewrite.site": set(),
    "attnrewrite.errors": set(),
    "attnrewrite.data": {"attnrewrite.errors"},
    "attnrewrite.record": {"attnrewrite.site", "attnrewrite.errors", "attnrewrite.version"},
    "attnrewrite.decision": BELOW_PASSES | {"attnrewrite.passes"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(folder: Path, root: Path) -> dict[str, ast.Module]:
    return {module_name(p, root): ast.parse(p.read_text()) for p in sorted(folder.rglob("*.py"))}


PACKAGE_MODULES = modules(PACKAGE, ROOT)


def imported(tree: ast.Module, known) -> list[tuple[str, str]]:
    """(module, name) for every import of ``known`` modules in ``tree``, function-level ones
    included; ``from package import submodule`` counts as the submodule."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.append((submodule, "") if submodule in known else (node.module, alias.name))
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
    return [(module, name) for module, name in found if module in known]


def private_uses(tree: ast.Module, known) -> list[str]:
    """Names starting with one underscore that ``tree`` takes from another module: imported by
    name, or read as an attribute of a module it imported."""
    names = [f"{module}.{name}" for module, name in imported(tree, known) if _private(name)]
    aliases = {
        alias.asname or alias.name: f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and _private(node.attr):
            target = aliases.get(node.value.id)
            if target in known:
                names.append(f"{target}.{node.attr}")
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


# Underscore names of other libraries' objects read where they offer no public one, and why.
# Another module of ours reading one of our underscore names is never among them.
FOREIGN_PRIVATE = {
    "_replace": "a namedtuple's public copy-with-changes",
    "_getframe": "sys: the caller's frame, for a warning's stacklevel",
    "_ops": "torch: the OpOverload type",
    "_schema": "torch: an OpOverload's schema",
    "_C": "torch: the C functions FX graphs call",
    "_nn": "torch: the C functions FX graphs call",
    "_qkv_same_embed_dim": "torch: whether nn.MultiheadAttention keeps separate projections",
    "_preprocess": "onnxruntime's symbolic shape inference, run step by step (onnx/io.py)",
    "_infer_impl": "onnxruntime's symbolic shape inference, run step by step (onnx/io.py)",
    "_update_output_from_vi": "onnxruntime's symbolic shape inference, run step by step (onnx/io.py)",
}


def defined_names(tree: ast.Module) -> set[str]:
    """Every name ``tree`` defines: functions, classes, arguments, and what it assigns,
    attributes included."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
    return names


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def private_attributes(tree: ast.Module, ours: set[str]) -> list[str]:
    """``x._name`` that ``tree`` reads but does not define: on anything but self and cls (unless
    a FOREIGN_PRIVATE of another library), and on self or cls where another module of ours
    defines it (a private inherited from another module's class). ``ours``: the names the
    other modules define."""
    own = defined_names(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or isinstance(node.ctx, ast.Store) or not _private(node.attr):
            continue
        if node.attr in own:
            continue
        if node.attr in ours or not (_on_self(node) or node.attr in FOREIGN_PRIVATE):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def private_methods_handed_over(tree: ast.Module, known) -> list[str]:
    """``self._method`` (a function ``tree`` defines) passed to a callable of another module of
    ours, which would then call this module's underscore name."""
    methods = {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not any(map(_is_property, n.decorator_list))
    }
    imported_names = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
        if ((node.module or "") if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0] in _roots(known)
    }
    found = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        callee = call.func
        while isinstance(callee, ast.Attribute):
            callee = callee.value
        if not (isinstance(callee, ast.Name) and callee.id in imported_names):
            continue
        for argument in [*call.args, *(k.value for k in call.keywords)]:
            if isinstance(argument, ast.Attribute) and _on_self(argument) and argument.attr in methods:
                if _private(argument.attr):
                    found.append(f"{ast.unparse(call.func)}(..., {ast.unparse(argument)}) (line {call.lineno})")
    return found


def _is_property(decorator: ast.expr) -> bool:
    return ast.unparse(decorator).split(".")[-1] in ("property", "cached_property")


def _roots(known) -> set[str]:
    return {name.split(".")[0] for name in known}


def test_no_import_cycle():
    graph = nx.DiGraph()
    for name, tree in PACKAGE_MODULES.items():
        graph.add_edges_from((name, module) for module, _ in imported(tree, PACKAGE_MODULES) if module != name)
    assert list(nx.simple_cycles(graph)) == []


BENCH_MODULES = modules(ROOT / "bench", ROOT / "bench")
ALL_MODULES = {**PACKAGE_MODULES, **BENCH_MODULES}


def test_no_module_takes_another_modules_private_names():
    taken = {name: private_uses(tree, ALL_MODULES) for name, tree in ALL_MODULES.items()}
    assert {name: uses for name, uses in taken.items() if uses} == {}


def test_no_module_reads_another_modules_private_attributes():
    """Imports aside: an underscore attribute read on another module's object, or inherited
    from another module's class, is that module's private name too."""
    defined = {name: defined_names(tree) for name, tree in ALL_MODULES.items()}
    read = {
        name: private_attributes(tree, set().union(*(d for other, d in defined.items() if other != name)))
        for name, tree in ALL_MODULES.items()
    }
    assert {name: uses for name, uses in read.items() if uses} == {}


def test_no_module_hands_its_private_methods_to_another():
    handed = {name: private_methods_handed_over(tree, ALL_MODULES) for name, tree in ALL_MODULES.items()}
    assert {name: uses for name, uses in handed.items() if uses} == {}


@pytest.mark.parametrize("layer", LAYERS)
def test_no_arrow_up(layer):
    """A layer imports itself and what lies below it, never what is built on it."""
    allowed = LAYERS[layer] | {layer}
    upward = {
        (name, module)
        for name, tree in PACKAGE_MODULES.items()
        if name == layer or name.startswith(f"{layer}.")
        for module, _ in imported(tree, PACKAGE_MODULES)
        if not any(module == a or module.startswith(f"{a}.") for a in allowed)
    }
    assert upward == set()


def test_no_file_over_the_limit():
    long = {
        str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_function_over_the_limit():
    long = {
        f"{name}.{node.name}": length
        for name, tree in PACKAGE_MODULES.items()
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    }
    assert long == {}


def test_every_method_declares_its_hooks():
    """Every method module defines each hook passes/hooks.py lists: none is looked up with a
    silent default."""
    assert {name: hooks.undeclared(method) for name, method in passes.PASSES.items()} == dict.fromkeys(
        passes.PASSES, []
    )


def test_a_misspelled_hook_is_refused():
    """A method module whose exact_part is spelled exact_prt, or that has both or neither of
    recurrence and NO_RECURRENCE, is refused (the registry raises at import), not taken as a
    method that is never exact."""
    misspelled = types.ModuleType("misspelled")
    misspelled.__dict__.update({k: v for k, v in vars(passes.linear).items() if k != "exact_part"})
    misspelled.exact_prt = passes.linear.exact_part
    assert hooks.undeclared(misspelled) == ["defines no exact_part"]
    misspelled.exact_part, misspelled.NO_RECURRENCE = passes.linear.exact_part, "no"
    assert hooks.undeclared(misspelled) == [
        "must define exactly one of recurrence and NO_RECURRENCE, not ['recurrence', 'NO_RECURRENCE']"
    ]
    misspelled.NO_WINDOW = "no"
    assert "must define NO_WINDOW exactly when its Options have no window" in hooks.undeclared(misspelled)


def test_every_method_declares_its_recurrence_and_the_shared_code_names_none():
    """A method has a recurrent form or says why not; what all recurrent forms share, and the
    ONNX splice of them, import no method."""
    for method in passes.PASSES.values():
        assert hasattr(method, "recurrence") != hasattr(method, "NO_RECURRENCE"), method.NAME
    methods = {f"attnrewrite.passes.{name}" for name in passes.PASSES}
    for shared in (
        "attnrewrite.passes.recurrent",
        "attnrewrite.onnx.recurrent",
        "attnrewrite.passes.kernel.recurrence",
        "attnrewrite.passes.kernel.recurrent_onnx",
        "attnrewrite.passes.kernel.recurrent_torch",
    ):
        taken = {module for module, _ in imported(PACKAGE_MODULES[shared], PACKAGE_MODULES)}
        assert taken & methods == set(), shared


def test_the_window_hybrid_is_lowered_from_one_call():
    """The methods reach the ONNX window hybrid through windowed_kernel, the one place that calls
    windowed_kernel_attention_functions."""
    calls = [
        name
        for name, tree in PACKAGE_MODULES.items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "windowed_kernel_attention_functions"
    ]
    assert calls == ["attnrewrite.passes.window.lowering"]
