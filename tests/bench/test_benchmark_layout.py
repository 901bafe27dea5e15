"""The benchmarks' size and import rules: no module in ``benchmarks/`` over 800 lines, no
function over 120, no import circle among the benchmark modules (imports inside functions and
under ``if TYPE_CHECKING:`` counted), and the one-off scripts of ``benchmarks/probes/`` outside
``make bench``.

Read from the source with `ast`. The scripts import each other by path (``benchmarks/`` on
``sys.path``: ``import suite``, ``from tasks import suite_tasks``), which the package's
architecture test (tests/test_architecture.py, ``kfac_stream`` imports only, 600 / 80) does not
read, so the helpers here are their own.
"""

import ast
import pathlib
import re

from import_graph import import_cycles_in
from repo_paths import BENCHMARKS, ROOT

MAX_MODULE_LINES, MAX_FUNCTION_LINES = 800, 120


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    """``benchmarks/tasks/suite_tasks.py`` -> ``tasks.suite_tasks``; a package's
    ``__init__.py`` -> the package's name."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, root: pathlib.Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere in its source (functions and
    ``TYPE_CHECKING`` blocks included); ``from package import name`` counts as importing
    ``package.name`` when that is a module, else the package."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                source = ".".join([p for p in base if p] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import tasks.pools as p` -> tasks.pools
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def import_cycles(root: pathlib.Path) -> list[str]:
    """Every import circle among the modules under ``root``, as ``a -> b -> a``."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    edges = {m: imported_modules(p, root, set(paths)) for m, p in paths.items()}
    return import_cycles_in(edges)


def over_limits(path: pathlib.Path, name: str) -> dict[str, int]:
    """``{what: lines}`` of what in ``path`` is over a limit: the module (``name``) or a
    function (``name:function``)."""
    src = path.read_text()
    out = {}
    if src.count("\n") > MAX_MODULE_LINES:
        out[name] = src.count("\n")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = node.end_lineno - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                out[f"{name}:{node.name}"] = n
    return out


def test_benchmark_modules_and_functions_stay_small():
    found = {k: v for p in sorted(BENCHMARKS.rglob("*.py"))
             for k, v in over_limits(p, p.relative_to(ROOT).as_posix()).items()}
    assert found == {}, f"over {MAX_MODULE_LINES} lines per benchmark module or " \
                        f"{MAX_FUNCTION_LINES} per function: {found}"


def test_no_import_circle_among_benchmark_modules():
    cycles = import_cycles(BENCHMARKS)
    assert not cycles, "\n".join(cycles)


def test_the_tasks_import_no_script():
    """A task module imports helpers and other task modules, never a benchmark script (the
    scripts are the top: they import the tasks)."""
    modules = {module_name(p, BENCHMARKS) for p in BENCHMARKS.rglob("*.py")}
    scripts = {m for m in modules if "." not in m and m != "tasks"
               and (BENCHMARKS / f"{m}.py").read_text().count('__name__ == "__main__"')}
    upward = {module_name(p, BENCHMARKS): imported_modules(p, BENCHMARKS, modules) & scripts
              for p in (BENCHMARKS / "tasks").glob("*.py")}
    assert {m: s for m, s in upward.items() if s} == {}


def test_make_bench_runs_scripts_and_no_probe():
    make = (ROOT / "Makefile").read_text()
    block = re.search(r"^BENCH_SCRIPTS :=(.*?)\n(?!\t| )", make, re.S | re.M).group(1)
    names = block.replace("\\", " ").split()
    assert len(names) >= 10
    assert [n for n in names if not (BENCHMARKS / f"{n}.py").exists()] == []
    probes = {p.stem for p in (BENCHMARKS / "probes").glob("*.py")}
    assert len(probes) >= 7 and probes.isdisjoint(names)


def test_the_checks_find_a_circle_and_an_oversize_module(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "__init__.py").write_text("")
    (tmp_path / "tasks" / "a.py").write_text("def f():\n    from tasks import b\n")
    (tmp_path / "tasks" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import script\n")
    (tmp_path / "script.py").write_text("from tasks.a import f\nimport _common\n")
    (tmp_path / "_common.py").write_text("import json\n")
    assert import_cycles(tmp_path) == ["script -> tasks.a -> tasks.b -> script"]
    (tmp_path / "tasks" / "b.py").write_text("from . import a\n")
    assert import_cycles(tmp_path) == ["tasks.a -> tasks.b -> tasks.a"]
    body = "\n".join(f"    x{i} = {i}" for i in range(121))
    (tmp_path / "big.py").write_text(f"def f():\n{body}\n" + "\n" * 700)
    assert over_limits(tmp_path / "big.py", "big") == {"big": 822, "big:f": 122}
