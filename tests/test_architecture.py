"""The module layering of the package: each module imports only those below it.

A newcomer reads the architecture from the file names (docs/architecture.md); this
test keeps it true. Moving a module or adding an upward import fails here, with
the offending import named.
"""

import ast
import pathlib
import re

import pytest

import jax_threadmap

PACKAGE = pathlib.Path(jax_threadmap.__file__).parent

#: Lowest first. A module may import only modules that come before it.
LAYERS = [
    "_errors",
    "_fork",
    "_event_loop",
    "_compat",
    "_validate",
    "_batch_spec",
    "_summing",
    "_remote",
    "_loops",
    "_vectorized",
    "_host",
    "_progress",
    "_scheduling",
    "_claims",
    "_jobs",
    "_threads",
    "_maps",
    "_async_kernels",
    "_params",
    "_autodiff",
    "_per_shard",
    "_primitive",
    "_api",
    "_leaves",
    "_async_threads",
    "_background",
    "_dispatch",
    "_arrays",
    "_shard_loads",
    "_inner_threads",
    "_demo",
    "__init__",
    "__main__",
]


def package_imports(path: pathlib.Path) -> set[str]:
    """The package modules that ``path`` imports, anywhere in the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module)
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "jax_threadmap"
        ):
            found.add(node.module.split(".")[1] if "." in node.module else "__init__")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jax_threadmap."):
                    found.add(alias.name.split(".")[1])
    return found


def test_every_module_has_a_layer():
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    assert modules == set(LAYERS)


def test_modules_import_only_lower_layers():
    upward = []
    for path in PACKAGE.glob("*.py"):
        rank = LAYERS.index(path.stem)
        for imported in package_imports(path):
            if LAYERS.index(imported) >= rank:
                upward.append(f"{path.stem} imports {imported}")
    assert upward == []


def test_the_checker_sees_upward_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from ._api import threadmap\n\nfrom . import _host\n")
    assert package_imports(bad) == {"_api", "_host"}


#: A module a newcomer reads in one sitting; the table of JAX hooks may stay one file.
MAX_MODULE_LINES = 600
LONG_MODULES_ALLOWED = {"_compat"}
#: Cyclomatic complexity (radon) of any function of the package.
MAX_COMPLEXITY = 15


def test_no_module_above_600_lines():
    long = {
        p.stem: n
        for p in PACKAGE.glob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert set(long) <= LONG_MODULES_ALLOWED, f"split these modules: {long}"


def test_no_function_above_complexity_15():
    complexity = pytest.importorskip("radon.complexity", reason="lint extra")
    over = [
        f"{p.name}:{f.lineno} {f.fullname} {f.complexity}"
        for p in sorted(PACKAGE.glob("*.py"))
        for b in complexity.cc_visit(p.read_text())
        for f in getattr(b, "methods", None) or [b]
        if f.complexity > MAX_COMPLEXITY
    ]
    assert over == [], "split these functions: " + "; ".join(over)


def test_one_fork_hook_for_the_package():
    # Every module's after-fork reset goes through _fork.in_child, so the order in
    # which a forked child starts afresh is read in one place.
    calls = [
        path.name
        for path in PACKAGE.glob("*.py")
        if "register_at_fork" in path.read_text() and path.stem != "_fork"
    ]
    assert calls == []


#: What no module may use to learn what another thread (or the interpreter) is
#: doing: profiler and tracer hooks, other threads' frames, bytecode.
INTROSPECTION = re.compile(
    r"\b(setprofile|settrace|_current_frames|current_frames|_getframe|f_locals"
    r"|f_back|f_lineno|f_lasti|import dis|from dis)\b"
)


def test_no_module_reads_frames_or_sets_profilers():
    # Threads publish what others must know (a chunk's cursor, a call's state);
    # none learns it from another thread's frames, a profiler or bytecode.
    found = {
        p.stem for p in PACKAGE.glob("*.py") if INTROSPECTION.search(p.read_text())
    }
    assert found == set(), sorted(found)
