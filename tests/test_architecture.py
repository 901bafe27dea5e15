"""The package's import structure: layers only import downwards, no import cycle, no private
name imported across modules, every error class in `kfac_stream.exceptions`.

Read from the source with `ast`: every import, also those inside functions and those under
``if TYPE_CHECKING:`` (a circle of type annotations is a circle of the design), so it holds
for code paths the other tests do not import.
"""

import ast
import pathlib

import pytest

import kfac_stream
from kfac_stream import exceptions

from import_graph import import_cycles_in

PACKAGE = pathlib.Path(kfac_stream.__file__).resolve().parent

# lower number = lower layer; a module may import its own layer or lower ones
LAYERS = {
    "exceptions": 0, "config": 0, "utils": 0,
    "stats": 1, "extensions": 1,
    "capture": 2, "store": 2, "distributed": 2, "snapshot": 2, "fisher": 2,
    "query": 3, "ekfac": 3,
    "tracking": 4,
    "integrations": 5,
    "app": 6, "cli": 6, "": 6,  # "": the package's __init__
}
#: The only modules at the package's root; everything else lives in a folder of its layer.
ROOT_MODULES = {"__init__.py", "config.py", "exceptions.py"}


def _module_name(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join([root.name, *parts])


def _imports(path: pathlib.Path, root: pathlib.Path = PACKAGE) -> list[tuple[str, list[str]]]:
    """``[(imported module, names)]`` of every import of the package at ``root`` in ``path``
    (module level, inside functions, under ``if TYPE_CHECKING:``: all of them)."""
    name = _module_name(path, root)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == root.name:
                names = [a.name for a in node.names]
                if not node.module:  # `from . import x`: x is a module
                    out.extend((f"{target}.{n}", []) for n in names)
                else:
                    out.append((target, names))
        elif isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names if a.name.split(".")[0] == root.name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return out


def _graph(root: pathlib.Path = PACKAGE) -> dict[str, list[tuple[str, list[str]]]]:
    return {_module_name(p, root): _imports(p, root) for p in sorted(root.rglob("*.py"))}


def _layer(module: str) -> int:
    top = module.removeprefix("kfac_stream").lstrip(".").split(".")[0]
    assert top in LAYERS, f"{module}: place {top!r} in a layer of tests/test_architecture.py"
    return LAYERS[top]


def test_the_root_holds_only_the_config_the_errors_and_the_package():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ROOT_MODULES)
    assert not loose, f"move {loose} into the folder of their layer (docs/layout.md)"
    assert {p.name for p in PACKAGE.glob("*.py")} == ROOT_MODULES


def test_layers_only_import_downwards():
    upward = [f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
              for m, imports in _graph().items() for t, _ in imports if _layer(t) > _layer(m)]
    assert not upward, "\n".join(upward)


def _cycles(graph: dict[str, list[tuple[str, list[str]]]]) -> list[str]:
    """Every import circle of ``graph`` (`_graph`) found by a depth-first walk, as
    ``"a -> b -> a"``."""
    modules = set(graph)

    def resolve(target: str, names: list[str]) -> set[str | None]:
        """The submodules ``from target import names`` names, or the module (the package)
        that defines the names."""
        subs = {f"{target}.{n}" for n in names} & modules
        if subs and len(subs) == len(names):
            return subs
        while target and target not in modules:
            target = target.rpartition(".")[0]
        return subs | {target or None}

    edges = {m: set().union(*(resolve(t, ns) for t, ns in imports)) - {None, m}
             for m, imports in graph.items()}
    return import_cycles_in(edges)


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(cycles)


def test_the_cycle_check_finds_a_type_level_circle(tmp_path):
    """A circle whose one arrow is an import under ``if TYPE_CHECKING:`` (and one inside a
    function) is found; the same package without that import has none."""
    root = tmp_path / "fakepkg"
    (root / "inner").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "inner" / "__init__.py").write_text("")
    (root / "a.py").write_text("from .inner import b\n")
    (root / "inner" / "b.py").write_text("def f():\n    from . import c\n")
    typed = ("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
             "    from ..a import A\n")
    (root / "inner" / "c.py").write_text(typed)
    graph = _graph(root)
    assert graph["fakepkg.inner.c"] == [("fakepkg.a", ["A"])]
    assert _cycles(graph) == ["fakepkg.a -> fakepkg.inner.b -> fakepkg.inner.c -> fakepkg.a"]
    (root / "inner" / "c.py").write_text("from typing import TYPE_CHECKING\n")
    assert _cycles(_graph(root)) == []


def test_no_private_name_imported_across_modules():
    private = [f"{m} imports {n} from {t}" for m, imports in _graph().items()
               for t, names in imports for n in names if n.startswith("_")]
    assert not private, "\n".join(private)


def test_every_error_class_lives_in_exceptions():
    defined = [f"{_module_name(p)}.{node.name}" for p in PACKAGE.rglob("*.py")
               if p.name != "exceptions.py"
               for node in ast.walk(ast.parse(p.read_text())) if isinstance(node, ast.ClassDef)
               and (node.name.endswith(("Error", "Exception")))]
    assert not defined, defined
    errors = [v for v in vars(exceptions).values()
              if isinstance(v, type) and issubclass(v, Exception)]
    assert len(errors) >= 7
    assert all(issubclass(e, exceptions.KFACStreamError) for e in errors)
    assert {e.__name__ for e in errors} <= set(kfac_stream.__all__)


# -- size limits: no module does several things ---------------------------------------------

MAX_MODULE_LINES, MAX_FUNCTION_LINES, MAX_POSITIONAL = 600, 80, 6
#: what is still over a limit, with why; a new offender, or one of these grown past its
#: figure, fails the test (remove an entry once it is split)
KNOWN_OVER_LIMIT: dict[str, int] = {}


def _over_limits(path: pathlib.Path, name: str) -> dict[str, int]:
    """``{what: size}`` of what in ``path`` (called ``name``) is over a limit: the module
    (``name``: lines), a function (``name:function``: lines), a call (``name:line call``:
    positional arguments)."""
    src = path.read_text()
    out = {}
    if src.count("\n") > MAX_MODULE_LINES:
        out[name] = src.count("\n")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out[f"{name}:{node.name}"] = n
        if isinstance(node, ast.Call) and len(node.args) > MAX_POSITIONAL:
            out[f"{name}:{node.lineno} call"] = len(node.args)
    return out


def test_modules_functions_and_calls_stay_small():
    found = {k: v for p in sorted(PACKAGE.rglob("*.py"))
             for k, v in _over_limits(p, p.relative_to(PACKAGE.parent).as_posix()).items()}
    new = {k: v for k, v in found.items()
           if v > KNOWN_OVER_LIMIT.get(k if not k.endswith(" call") else k.split(":")[0] + ":call",
                                       0)}
    assert new == {}, f"over {MAX_MODULE_LINES} lines per module, {MAX_FUNCTION_LINES} per " \
                      f"function or {MAX_POSITIONAL} positional arguments per call: {new}"


def test_the_size_check_finds_an_offender(tmp_path):
    big = tmp_path / "big.py"
    body = "\n".join(f"    x{i} = {i}" for i in range(90))
    big.write_text(f"def f():\n{body}\n\n\nf(1, 2, 3, 4, 5, 6, 7)\n")
    assert _over_limits(big, "big") == {"big:f": 91, "big:94 call": 7}


def test_the_callback_forwards_nothing_implicitly():
    """`KFACStreamCallback` declares what it exposes (no ``__getattr__`` reading through to
    the session): an unknown name is an AttributeError, a declared one is the session's."""
    from kfac_stream import KFACStreamCallback

    assert "__getattr__" not in vars(KFACStreamCallback)
    cb = KFACStreamCallback()
    assert cb.snapshots is cb.session.snapshots and cb.tracker is None and cb.plan is None
    with pytest.raises(AttributeError):
        cb.background_snapshots  # noqa: B018 (a session option, not the callback's)
