"""The layering of the package's subpackages: each imports only those below it,
and the two wings (maps, async arrays) meet only in shared support (the
coroutines wing's event loop among it).

A newcomer reads the architecture from the folder and file names
(docs/architecture.md); this test keeps it true. An import across the wings, or
upward, fails here with the offending import named.
"""

import ast
import pathlib
import re

import pytest

import jax_threadmap

PACKAGE = pathlib.Path(jax_threadmap.__file__).parent

#: The subpackages, and those each may import. The two wings, maps (``_core``,
#: ``_host``, ``_executors``) and async arrays (``_arrays``), meet only in what
#: they share: ``_support``, ``_jax`` (the one home of JAX internals) and the
#: coroutines wing (``_coroutines``: the event loop both run ``async def`` code
#: on, shared resources, and ``async def`` kernels, whose maps are the maps
#: wing's: the arrays wing imports only what reaches neither).
ALLOWED = {
    "_jax": set(),
    "_support": {"_jax"},
    "_host": {"_support", "_jax"},
    "_executors": {"_support", "_host"},
    "_coroutines": {"_support", "_host", "_executors"},
    "_core": {"_support", "_jax", "_host", "_executors", "_coroutines"},
    "_arrays": {"_support", "_jax", "_coroutines"},
}
WINGS = {"maps": {"_core", "_host", "_executors"}, "async arrays": {"_arrays"}}


def modules() -> dict[str, pathlib.Path]:
    """Every module of the package by dotted name below it ("_core.api")."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        found[".".join(parts)] = path
    return found


def package_imports(path: pathlib.Path, name: str) -> set[str]:
    """The package modules (dotted, below the package) that module ``name`` at
    ``path`` imports, anywhere in the file."""
    here = name.split(".")[:-1]  # the module's own subpackage
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = here[: len(here) - (node.level - 1)]
            where = [*base, *(node.module or "").split(".")] if node.module else base
            for a in node.names:  # a name may be a module of that package
                sub = [*where, a.name]
                is_module = PACKAGE.joinpath(*sub).with_suffix(".py").exists()
                found.add(".".join(sub if is_module else where))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "jax_threadmap."
        ):
            found.add(node.module.split(".", 1)[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("jax_threadmap."):
                    found.add(alias.name.split(".", 1)[1])
    return found


def _subpackage(module: str) -> str:
    return module.split(".")[0]


def test_every_module_is_in_a_subpackage():
    top = {m for m in modules() if "." not in m}
    assert top == {"__init__"}, sorted(top)
    subpackages = {_subpackage(m) for m in modules()} - top
    assert subpackages == set(ALLOWED)


def test_subpackages_import_only_those_below_them():
    wrong = []
    for name, path in modules().items():
        sub = _subpackage(name)
        if sub not in ALLOWED:
            continue  # __init__ imports the public names
        for imported in package_imports(path, name):
            other = _subpackage(imported)
            if other != sub and other not in ALLOWED[sub]:
                wrong.append(f"{name} imports {imported}")
    assert wrong == []


def import_graph() -> dict[str, set[str]]:
    """Each module of the package, and the package modules it imports."""
    known = modules()
    return {
        name: {m for m in package_imports(path, name) if m in known}
        for name, path in known.items()
    }


def test_the_wings_meet_only_in_shared_support():
    # Through any chain of imports: the arrays wing's use of the event loop
    # (_coroutines) must not reach async def kernels, whose maps are the maps wing's.
    maps, arrays = WINGS.values()
    assert not any(ALLOWED[a] & maps for a in arrays)
    assert not any(ALLOWED[m] & arrays for m in maps)
    graph = import_graph()
    for wing, other in ((arrays, maps), (maps, arrays)):
        seen = {m for m in graph if _subpackage(m) in wing}
        todo = list(seen)
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        assert {m for m in seen if _subpackage(m) in other} == set(), wing


def test_no_import_cycle_between_modules():
    graph = import_graph()
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            pytest.fail("import cycle: " + " -> ".join([*stack, node]))
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*stack, node])
        done.add(node)

    for name in sorted(graph):
        if name != "__init__":
            visit(name, [])


def test_no_two_modules_share_a_name_or_differ_by_a_suffix():
    # A reader picks the room by its name (issue 59): primitive.py beside
    # primitive_rules.py, or auto_shard.py beside auto_sharding.py, hid which
    # held what.
    stems = [m.rsplit(".", 1)[-1] for m in modules() if not m.endswith("__init__")]
    alike = sorted((a, b) for a in stems for b in stems if a != b and b.startswith(a))
    assert alike == [] and len(set(stems)) == len(stems), alike


def test_the_checker_sees_imports_across_subpackages(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n    from .._core.api import threadmap\n\n"
        "from . import async_pool\nfrom .._executors import jobs\n"
    )
    found = package_imports(bad, "_arrays.bad")
    assert found == {"_core.api", "_arrays.async_pool", "_executors.jobs"}


#: The one module that finds JAX's internals: the hook table. The feature code
#: built on it (the other modules of ``_jax``) asks it for them by name.
HOOK_TABLE = "_jax.hooks"
#: The table's forms: how a hook is described, found and adapted.
HOOK_FORMS = "_jax.hook_forms"
#: Where JAX keeps what it promises nothing about.
PRIVATE_JAX = re.compile(r"^(jax\._src|jaxlib\._)")


def private_jax_imports(path: pathlib.Path) -> list[str]:
    """The private JAX modules that the module at ``path`` imports: import
    statements, ``importlib.import_module`` and ``__import__`` of a literal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if PRIVATE_JAX.match(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            if PRIVATE_JAX.match(node.module or ""):
                found.append(node.module)
        elif isinstance(node, ast.Call) and node.args:
            func, first = node.func, node.args[0]
            name = getattr(func, "attr", None) or getattr(func, "id", None)
            if (
                name in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and PRIVATE_JAX.match(first.value)
            ):
                found.append(first.value)
    return found


def test_jax_internals_are_reached_only_through_the_hook_table():
    outside = {
        name: found
        for name, path in modules().items()
        if name != HOOK_TABLE and (found := private_jax_imports(path))
    }
    assert outside == {}, "add these to HOOKS in _jax/hooks.py instead"


def test_the_hook_table_holds_no_feature_code_and_imports_no_package_module():
    # tests/_jax/test_compat.py loads the table alone, to hide every hook before the
    # package is imported; the feature code lives in the other _jax modules.
    # (Its forms, versions and adapters live in _jax/hook_forms.py, which
    # imports no package module either.)
    path = modules()[HOOK_TABLE]
    assert package_imports(path, HOOK_TABLE) <= {HOOK_FORMS}
    assert package_imports(modules()[HOOK_FORMS], HOOK_FORMS) == set()
    others = {
        m
        for m in modules()
        if m.startswith("_jax.") and m not in (HOOK_TABLE, HOOK_FORMS)
    }
    assert others - {"_jax.__init__"}, "the feature code lives beside the table"
    for name in others:
        imported = package_imports(modules()[name], name)
        assert imported <= {HOOK_TABLE}, f"{name} imports {imported}"


def test_the_checker_sees_private_jax_imports(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import importlib\nfrom jax._src import core\nimport jaxlib._jax\n"
        "x = importlib.import_module('jax._src.dispatch')\n"
        "from jax import numpy\n"
    )
    assert private_jax_imports(bad) == ["jax._src", "jaxlib._jax", "jax._src.dispatch"]


#: Cyclomatic complexity (radon) of any function of the package.
MAX_COMPLEXITY = 15


def test_no_function_above_complexity_15():
    complexity = pytest.importorskip("radon.complexity", reason="lint extra")
    over = [
        f"{p.name}:{f.lineno} {f.fullname} {f.complexity}"
        for p in sorted(PACKAGE.rglob("*.py"))
        for b in complexity.cc_visit(p.read_text())
        for f in getattr(b, "methods", None) or [b]
        if f.complexity > MAX_COMPLEXITY
    ]
    assert over == [], "split these functions: " + "; ".join(over)


#: Sizes a reader can hold (issue 50): lines of a module, and of a class.
MAX_MODULE_LINES = 650
MAX_CLASS_LINES = 450


def test_no_module_or_class_too_long_to_hold():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            long.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    long.append(f"{path.name}:{node.lineno} {node.name}: {size} lines")
    assert long == [], (
        f"split these by job (modules <= {MAX_MODULE_LINES} lines, classes <= "
        f"{MAX_CLASS_LINES}): " + "; ".join(long)
    )


def test_one_fork_hook_for_the_package():
    # Every module's after-fork reset goes through _fork.in_child, so the order in
    # which a forked child starts afresh is read in one place.
    calls = [
        path.name
        for path in PACKAGE.rglob("*.py")
        if "register_at_fork" in path.read_text() and path.name != "fork.py"
    ]
    assert calls == []


def test_a_forked_child_resets_the_layers_lowest_first():
    # fork.LAYERS: every subpackage, each after those it may import.
    from jax_threadmap._support import fork

    assert set(fork.LAYERS) == set(ALLOWED)
    for k, sub in enumerate(fork.LAYERS):
        assert ALLOWED[sub] <= set(fork.LAYERS[:k]), sub


def test_every_owner_of_process_wide_state_has_a_row_in_the_docs():
    # docs/architecture.md, "Process-wide state": each module whose state a
    # forked child resets, or that rebinds a module-level name, is listed there
    # with its lock and fork rule.
    from jax_threadmap._support import fork

    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = docs.split("## Process-wide state")[1].split("\n## ")[0]
    owners = {r.__module__.removeprefix("jax_threadmap.") for r in fork.resets} | {
        name
        for name, path in modules().items()
        if any(isinstance(n, ast.Global) for n in ast.walk(ast.parse(path.read_text())))
    }
    missing = [m for m in owners if f"`{m.replace('.', '/')}.py`" not in table]
    assert missing == [], missing


#: What no module may use to learn what another thread (or the interpreter) is
#: doing: profiler and tracer hooks, other threads' frames, bytecode.
INTROSPECTION = re.compile(
    r"\b(setprofile|settrace|_current_frames|current_frames|_getframe|f_locals"
    r"|f_back|f_lineno|f_lasti|import dis|from dis)\b"
)


def test_no_module_reads_frames_or_sets_profilers():
    # Threads publish what others must know (a map's failure, a call's state);
    # none learns it from another thread's frames, a profiler or bytecode.
    found = {
        p.stem for p in PACKAGE.rglob("*.py") if INTROSPECTION.search(p.read_text())
    }
    assert found == set(), sorted(found)


#: The state machines of the async wing with one owner each: the module that
#: owns the class, the private fields no other module may touch, and the names
#: of the package's classes derived from it (``Task``, a sharded load).
def _owned_fields() -> dict[str, tuple[str, set[str], set[str]]]:
    from jax_threadmap._arrays.async_array import AsyncArray
    from jax_threadmap._arrays.task import Task

    def owned(module: str, cls: type) -> tuple[str, set[str], set[str]]:
        slots = [n for c in cls.__mro__ for n in c.__dict__.get("__slots__", ())]
        private = {n for n in slots if n.startswith("_") and n[:2] != "__"}
        derived, todo = {cls.__name__}, [cls]
        while todo:
            for sub in todo.pop().__subclasses__():
                derived.add(sub.__name__)
                todo.append(sub)
        return module, private, derived

    return {
        "Task": owned("_arrays.task", Task),
        "AsyncArray": owned("_arrays.async_array", AsyncArray),
    }


def owner_violations(path: pathlib.Path, name: str) -> list[str]:
    """The private fields of an owned class (``Task``, ``AsyncArray``) that the
    module ``name`` at ``path`` touches: on any object but ``self``, and on
    ``self`` in a class derived from the owned class (``class ShardedLoad(Task)``
    touching a ``Task``'s field)."""
    found = []
    tree = ast.parse(path.read_text())
    for cls_name, (owner, fields, derived) in _owned_fields().items():
        if name == owner:
            continue
        subclass_bodies = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.ClassDef)
            and any(getattr(b, "id", None) in derived for b in node.bases)
        ]
        in_subclass = {id(n) for c in subclass_bodies for n in ast.walk(c)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or node.attr not in fields:
                continue
            on_self = isinstance(node.value, ast.Name) and node.value.id == "self"
            if not on_self or id(node) in in_subclass:
                found.append(f"{name}:{node.lineno} {ast.unparse(node)} ({cls_name})")
    return found


def test_a_call_and_an_array_are_changed_only_by_their_own_modules():
    # One owner, enforced: a Task subclass (the sharded load) uses Task's
    # override points, and async dispatch reaches an array's call and leaf
    # through the record the array's module hands it (dispatch.Pending).
    found = [
        v
        for name, path in modules().items()
        if name.startswith("_arrays.")
        for v in owner_violations(path, name)
    ]
    assert found == [], found


def test_the_owner_checker_sees_fields_touched_from_outside(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "class Load(Task):\n    def f(self):\n        self._state = 'running'\n\n"
        "def plan(x):\n    return x._task, x._index, x.task._state\n\n"
        "class Other:\n    def g(self):\n        return self._lock\n"
    )
    found = owner_violations(bad, "_arrays.bad")
    assert [f.split(" ", 1)[1] for f in found] == [
        "self._state (Task)",
        "x.task._state (Task)",
        "x._task (AsyncArray)",
        "x._index (AsyncArray)",
    ], found


def test_test_files_are_named_by_the_room_they_exercise():
    # As the package is grouped (issue 50): tests/_arrays/test_async_pool.py, not
    # tests/test_arrays_defects.py. A test file named by an attitude hides
    # what it tests; put a new case in the file of the room it exercises.
    attitudes = ("hostile", "defects", "robust", "deadlock", "faults", "regressions")
    tests = pathlib.Path(__file__).parents[1]
    named = [
        p.name for p in tests.rglob("test_*.py") if any(a in p.stem for a in attitudes)
    ]
    assert named == [], named


def test_test_folders_mirror_the_wings():
    # tests/_core/ holds the tests of jax_threadmap/_core/, and so on for each
    # wing; tests/docs/ and tests/project/ the suites that cross them. A test
    # file directly in tests/ (beside conftest.py and the helpers) or in a
    # folder named for no wing fails here; basenames are unique, as pytest's
    # default import mode needs.
    tests = pathlib.Path(__file__).parents[1]
    files = sorted(tests.rglob("test_*.py"))
    folders = {p.parent.relative_to(tests).as_posix() for p in files}
    assert folders <= {*ALLOWED, "docs", "project"}, folders
    assert set(ALLOWED) <= folders, set(ALLOWED) - folders
    names = [p.name for p in files]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
