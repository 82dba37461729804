"""Every Python code block of README.md and docs/*.md runs, so the docs cannot rot.

Blocks of one file run in order in one namespace, like a reader following the
page; each block is its own test. An HTML comment on the line just before a
block (invisible on the rendered page) changes how it runs:

- ``<!-- test: skip REASON -->``: not run, e.g. it needs a network or a
  cluster. Such a block has a runnable local twin on the same page.
- ``<!-- test: requires NAME -->``: skipped while ``NAME`` cannot be found.
  ``NAME`` is a module or a dotted attribute (``jax_threadmap.async_call``), or a
  keyword of a function (``jax_threadmap.threadmap(progress=)``), so a page can
  document an API that another branch adds and start running once it lands.
- ``<!-- test: devices N -->``: runs in a subprocess with ``N`` CPU devices
  (``--xla_force_host_platform_device_count``, which must be set before JAX
  starts), after the page's earlier runnable blocks; for ``shard_map`` and
  ``NamedSharding`` examples. The main session keeps one device, and the names
  such a block defines are not seen by the blocks after it.
- ``<!-- test: output -->`` before a ``text`` block: the block must match what
  the page's previous Python block printed (doctest rules, ``...`` matches
  anything), so printed jaxprs and tables stay true. In a printed jaxpr, what
  JAX prints for its own primitives' params differs between JAX versions (e.g.
  ``scan`` gained ``ft_in``), so both sides are compared without them: the
  ``threadmap`` equation (its params and batch spec), the equations and the
  nesting of sub-jaxprs are compared in full (:func:`jax_params_dropped`).

Shell blocks (``bash``) are not run here: README's two commands are what
``.ci/run`` runs, and ``tests/test_demo.py`` runs the demo. The docstring
examples that the API reference shows run as doctests below.
"""

from __future__ import annotations

import contextlib
import doctest
import importlib
import inspect
import io
import linecache
import os
import pathlib
import re
import subprocess
import sys

import pytest

import jax_threadmap

ROOT = pathlib.Path(__file__).resolve().parent.parent
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_MARK = re.compile(
    r"^\s*<!--\s*test:\s*(?P<kind>skip|requires|output|devices)\b\s*(?P<arg>.*?)\s*-->"
)


def blocks(path: pathlib.Path) -> list[dict]:
    """The fenced code blocks of a markdown file, with their markers."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or not m["lang"]:
            i += 1
            continue
        indent, start = len(m["indent"]), i
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        marks, k = [], start - 1
        while k >= 0 and _MARK.match(lines[k]):
            marks.append(_MARK.match(lines[k]).groupdict())
            k -= 1
        code = "\n".join(line[indent:] for line in lines[start + 1 : j])
        found.append(
            {"lang": m["lang"], "line": start + 1, "code": code, "marks": marks}
        )
        i = j + 1
    return found


def missing(name: str) -> bool:
    """Whether ``name`` (module, dotted attribute, or ``fn(keyword=)``) is absent."""
    keyword = None
    if name.endswith("=)"):
        name, keyword = name[:-2].split("(")
    parts = name.split(".")
    obj = None
    for n in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:n]))
        except ImportError:
            continue
        for attr in parts[n:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                return True
        break
    if obj is None:
        return True
    return keyword is not None and keyword not in inspect.signature(obj).parameters


def _is_python(b) -> bool:
    return b["lang"] in ("python", "py")


def _is_output(b) -> bool:
    return any(m["kind"] == "output" for m in b["marks"])


PY_BLOCKS = [
    (path, b) for path in FILES for b in blocks(path) if _is_python(b) or _is_output(b)
]


def _skip_reason(block) -> str | None:
    for mark in block["marks"]:
        if mark["kind"] == "skip":
            return mark["arg"] or "marked skip"
        if mark["kind"] == "requires" and missing(mark["arg"]):
            return f"needs {mark['arg']}, which this build of jax_threadmap lacks"
    return None


_namespaces: dict[pathlib.Path, dict] = {}


@pytest.mark.parametrize(
    "path,block",
    PY_BLOCKS,
    ids=[f"{p.relative_to(ROOT)}:{b['line']}" for p, b in PY_BLOCKS],
)
def test_doc_block_runs(path, block):
    reason = _skip_reason(block)
    if reason:
        pytest.skip(reason)
    namespace = _namespaces.setdefault(path, {"__name__": "__doc_block__"})
    ran = namespace.setdefault("__ran__", set())
    # Run the file's earlier runnable blocks first when this one runs alone.
    for p, b in PY_BLOCKS:
        if p != path or b is block:
            break
        if _is_python(b) and b["line"] not in ran and not _skip_reason(b):
            _run(path, b, namespace)
    devices = [int(m["arg"]) for m in block["marks"] if m["kind"] == "devices"]
    if devices:
        _run_with_devices(path, block, devices[0])
        return
    if _is_python(block):
        _run(path, block, namespace)
        return
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    want, got = block["code"] + "\n", namespace.get("__stdout__", "")
    want, got = jax_params_dropped(want), jax_params_dropped(got)
    assert checker.check_output(want, got, flags), (
        f"{path.name}:{block['line']}: the output shown differs from what the "
        f"block before it prints now:\n{got}"
    )


# In a printed jaxpr: an equation whose params follow on their own lines
# ("e:f32[5] = scan["), one param line ("length=4"), a param holding a sub-jaxpr
# ("jaxpr={ lambda ; ..."), the end of an equation's params ("] a b"), and an
# equation with its params on one line ("c:f32[4] = transpose[permutation=(0,)] a").
_EQN_OPEN = re.compile(r"= (?P<prim>[\w-]+)\[$")
_PARAM = re.compile(r"^\s*\w+=")
_SUB_JAXPR = re.compile(r"^\s*\w+=\{ lambda ")
_EQN_CLOSE = re.compile(r"^\s*\](\s|$)")
_INLINE_PARAMS = re.compile(r"= (?P<prim>[\w-]+)\[[^\]]*\]")


def jax_params_dropped(text: str) -> str:
    """A printed jaxpr without the params of primitives other than ``threadmap``.

    A line that is only ``...`` (the docs' elision) is joined to the line before
    it, so that it may also stand for nothing once params are dropped. Text that
    is not a jaxpr is returned as it is.
    """
    if not text.lstrip().startswith("{ lambda "):
        return text
    lines, open_eqns = [], []
    for line in text.splitlines():
        if m := _EQN_OPEN.search(line):
            open_eqns.append(m["prim"])
        elif open_eqns and _EQN_CLOSE.match(line):
            open_eqns.pop()
        elif (
            open_eqns
            and open_eqns[-1] != "threadmap"
            and _PARAM.match(line)
            and not _SUB_JAXPR.match(line)
        ):
            continue
        if "= threadmap[" not in line:
            line = _INLINE_PARAMS.sub(r"= \g<prim>[...]", line)
        if line.strip() == "..." and lines:
            lines[-1] += "..."
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def _run(path, block, namespace) -> None:
    namespace["__ran__"].add(block["line"])
    filename = f"{path.relative_to(ROOT)}:{block['line']}"
    code = compile(block["code"], filename, "exec")
    # Tracebacks (and the kernel frames in a KernelError) quote the block's lines.
    lines = block["code"].splitlines(keepends=True)
    linecache.cache[filename] = (len(block["code"]), None, lines, filename)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(code, namespace)
    namespace["__stdout__"] = buffer.getvalue()
    print(buffer.getvalue(), end="")


def _run_with_devices(path, block, devices: int) -> None:
    earlier = []
    for p, b in PY_BLOCKS:
        if p == path and b is not block and _is_python(b) and not _skip_reason(b):
            earlier.append(b["code"])
        if b is block:
            break
    script = "\n\n".join([*earlier, block["code"]])
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}"
    )
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert proc.returncode == 0, (
        f"{path.name}:{block['line']} failed on {devices} CPU devices:\n"
        f"{proc.stderr[-3000:]}"
    )


def test_every_page_has_blocks_that_parse():
    assert PY_BLOCKS, "no Python blocks found"
    for path, b in PY_BLOCKS:
        if _is_python(b):
            compile(b["code"], f"{path.name}:{b['line']}", "exec")


def test_readme_has_exactly_the_two_commands_that_ci_runs():
    shell = [b for b in blocks(ROOT / "README.md") if b["lang"] == "bash"]
    assert [len(b["code"].splitlines()) for b in shell] == [1, 1]
    demo, tests = (b["code"] for b in shell)
    assert demo.endswith("-m jax_threadmap")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests.split("&& ")[-1] in ci


@pytest.mark.parametrize("name", jax_threadmap.__all__)
def test_api_reference_examples(name):
    obj = getattr(jax_threadmap, name)
    # Methods too (KernelFunction.defvjp, AsyncArray.result, ...): the API page
    # shows their examples.
    finder = doctest.DocTestFinder()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = finder.find(obj, name, globs={}, module=inspect.getmodule(obj))
    assert all(t.name.startswith(name) for t in tests)
    for test in tests:
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0


def test_printed_jaxprs_are_compared_without_jax_params():
    # The same program as JAX 0.10 and 0.11 print it: scan's params differ.
    old = """{ lambda ; a:f32[3] b:f32[9]. let
    c:f32[3] = scan[
      _split_transpose=False
      jaxpr={ lambda ; d:f32[9] e:f32[]. let
          f:f32[] = threadmap[
            executor=None
            spec=BatchSpec(shape=(), in_axes=[(), ()])
          ] e d
        in (f,) }
      length=3
    ] b a
    g:f32[3] = transpose[permutation=(0,)] c
  in (g,) }
"""
    new = old.replace("_split_transpose=False", "ft_in=((None,), ())").replace(
        "permutation=(0,)", "permutation=(0,) sharding=None"
    )
    assert jax_params_dropped(old) == jax_params_dropped(new)
    kept = jax_params_dropped(new)
    assert "executor=None" in kept
    assert "spec=BatchSpec(shape=(), in_axes=[(), ()])" in kept
    assert "length=3" not in kept and "ft_in" not in kept
    assert "jaxpr={ lambda ; d:f32[9] e:f32[]. let" in kept
    # ...but never the threadmap equation's own params:
    other_spec = old.replace("in_axes=[(), ()]", "in_axes=[(0,), ()]")
    assert jax_params_dropped(other_spec) != jax_params_dropped(old)
    assert jax_params_dropped("BatchSpec(shape=(2,))\n") == "BatchSpec(shape=(2,))\n"
