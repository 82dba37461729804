"""Every Python code block of README.md and docs/*.md runs, so the docs cannot rot.

A reader may paste one block into a fresh file: each block runs alone, or its
first line says ``# Continues the example above.`` (visible on the page), and
the site then ends the page with its examples as one script
(docs/hooks/page_script.py). So each block that says nothing also runs alone, in
a fresh process (but for the page's first, which its page's script runs alone
already) and must print what the page shows there too.

A page's blocks also run as pasted by a reader: in order, as one script, with
``python FILE`` in a fresh directory and process (each block at its own line
of the page, so tracebacks quote the page's line numbers). The script must
exit with status 0 and write nothing to stderr (no warning, no traceback at
exit), and each block must print exactly what the page says it prints: the
``text`` block after it (marked ``output``, below), or its ``# prints: TEXT``
comments, one line of output each, or nothing. Each block is its own test. An HTML
comment on the line just before a block (invisible on the rendered page)
changes how it runs:

- ``<!-- test: skip REASON -->``: not run, e.g. it needs a network or a
  cluster. Such a block has a runnable local twin on the same page.
- ``<!-- test: requires NAME -->``: skipped while ``NAME`` cannot be found.
  ``NAME`` is a module or a dotted attribute (``jax_threadmap.async_call``), or a
  keyword of a function (``jax_threadmap.threadmap(progress=)``), so a page can
  document an API that another branch adds and start running once it lands.
- ``<!-- test: devices N -->``: runs in a subprocess with ``N`` CPU devices
  (``--xla_force_host_platform_device_count``, which must be set before JAX
  starts), after the page's earlier runnable blocks; for ``shard_map`` and
  ``NamedSharding`` examples. The page's own script leaves it out, and the
  names it defines are not seen by the blocks after it.
- ``<!-- test: alone -->``: a complete script (e.g. one with an
  ``if __name__ == "__main__":`` guard for a process pool), run alone in a
  fresh process rather than after the page's earlier blocks.
- ``<!-- test: output -->`` before a ``text`` block: the block must match what
  the page's previous Python block printed (doctest rules, ``...`` matches
  anything), so printed jaxprs and tables stay true.
  ``<!-- test: output measured -->``: the same, but output measured on some
  machine (timings, thread counts), which the page names: each number shown
  stands for any number, the words and lines around it must match. In a printed
  jaxpr, what
  JAX prints for its own primitives' params differs between JAX versions (e.g.
  ``scan`` gained ``ft_in``), so both sides are compared without them: the
  ``threadmap`` equation (its params and batch spec), the equations and the
  nesting of sub-jaxprs are compared in full (``jax_params_dropped``).

Shell blocks (``bash``) are not run here: README's two commands are what
``.ci/run`` runs, and ``tests/docs/test_demo.py`` runs the demo. Each shell block
is checked instead (``test_shell_block_runs_after_the_readme_set_up``): it
runs as written after the README's set-up (``python3 -m venv .venv && .venv/bin/pip
install -q .``, from the repository's root), so its ``python``, ``pip``,
``pytest`` and ``mkdocs`` are those of ``.venv/bin/``, and it installs the
extras that what it runs needs (``.venv/bin/pip install -q ".[examples]"``);
inline code that is a command uses ``.venv/bin/`` too. A Python block that
imports what ``pip install .`` does not install (``scipy``, ``aiohttp``, the
``examples`` folder's ducc0) has, above it on its page, the command that does
(``test_doc_block_says_how_to_install_what_it_imports``). The docstring examples
that the API reference shows run as doctests below.
"""

from __future__ import annotations

import doctest
import functools
import importlib
import inspect
import os
import pathlib
import re
import sys

import pytest

import jax_threadmap

sys.path.insert(0, str(pathlib.Path(__file__).parents[1]))
from helpers import (  # noqa: E402
    LOOPBACK,
    NO_LOOPBACK,
    package_settings,
    run_script,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Runs in child processes on the CPU (conftest.py, tests/tpu_suite.sh).
pytestmark = pytest.mark.children

sys.path.insert(0, str(ROOT / "docs" / "hooks"))
import page_script as pages  # noqa: E402  (the site's hook reads the pages too)


def blocks(path: pathlib.Path) -> list[dict]:
    """The fenced code blocks of a markdown file, with their markers."""
    return pages.blocks(path.read_text())


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


_is_python = pages.is_python


def _is_output(b) -> bool:
    return any(m["kind"] == "output" for m in b["marks"])


def _devices(b) -> int | None:
    found = [int(m["arg"]) for m in b["marks"] if m["kind"] == "devices"]
    return found[0] if found else None


def _alone(b) -> bool:
    return any(m["kind"] == "alone" for m in b["marks"])


def _own_script(b) -> bool:
    """Whether the block runs in a script of its own, not in its page's."""
    return bool(_devices(b)) or _alone(b)


PY_BLOCKS = [(path, b) for path in FILES for b in blocks(path) if _is_python(b)]


def _skip_reason(block) -> str | None:
    for mark in block["marks"]:
        if mark["kind"] == "skip":
            return mark["arg"] or "marked skip"
        if mark["kind"] == "requires" and mark["arg"] == "loopback":
            if not LOOPBACK:  # a local server (a lent TPU host refuses it)
                return f"the page's local server {NO_LOOPBACK}"
            continue
        if mark["kind"] == "requires" and missing(mark["arg"]):
            return f"needs {mark['arg']}, which this build of jax_threadmap lacks"
    return None


_NUMBER = re.compile(r"\d+(?:\.\d+)?(?:e[+-]?\d+)?")
_PRINTS = re.compile(r"#[^#\n]*?\bprints: ?(?P<text>.*?)\s*$")


def expected_output(path: pathlib.Path, block: dict) -> str:
    """What the page says ``block`` prints: "" when it shows nothing.

    Either the ``text`` block after it, marked ``<!-- test: output -->``, or the
    ``# prints: TEXT`` comments in the block, one line of output each, in order.
    """
    found = blocks(path)
    i = next(k for k, b in enumerate(found) if b["line"] == block["line"])
    if i + 1 < len(found) and _is_output(found[i + 1]):
        shown = found[i + 1]["code"] + "\n"
        if any(m["arg"] == "measured" for m in found[i + 1]["marks"]):
            shown = _NUMBER.sub("...", shown)
        return shown
    lines = [m["text"] for m in map(_PRINTS.search, block["code"].splitlines()) if m]
    return "".join(line + "\n" for line in lines)


def _sentinel(line: int) -> str:
    return f"\x1edoc-block {line}\x1e\n"


def page_script(path: pathlib.Path, last: dict | None = None) -> str:
    """The page's runnable blocks as one script, each at its line of the page.

    So that tracebacks quote the page's own line numbers, a block's code starts
    on the line after its fence, where a statement that prints a separator
    stands (parsed apart by ``block_outputs``). Blocks that run in a script of
    their own are left out, except ``last``: the script then ends with it, and
    is only ``last`` when that is a complete script (``alone``).
    """
    lines: list[str] = []
    for p, b in PY_BLOCKS:
        if p != path or _skip_reason(b) or (_own_script(b) and b is not last):
            continue
        if last is not None and _alone(last) and b is not last:
            continue
        lines += [""] * (b["line"] - 1 - len(lines))
        lines.append(f"print({_sentinel(b['line'])!r}, end='', flush=True)")
        lines += b["code"].splitlines()
        if b is last:
            break
    return "\n".join(lines) + "\n"


def alone_script(block: dict) -> str:
    """``block`` alone, at its line of the page, as a reader pastes it."""
    pad = "\n" * (block["line"] - 1)
    return f"{pad}print({_sentinel(block['line'])!r}, end='', flush=True)\n" + (
        block["code"] + "\n"
    )


def needs_alone_run(path: pathlib.Path, block: dict) -> bool:
    """Whether ``block`` must also run alone: it says it continues nothing.

    Blocks with their own script, and the first of the page's script (which
    runs it alone already), need no run of their own.
    """
    if _skip_reason(block) or _own_script(block) or pages.continues(block):
        return False
    first = next(b for p, b in PY_BLOCKS if p == path and pages.in_page_script(b))
    return block is not first


def run_page(path: pathlib.Path, script: str, devices: int | None = None):
    """Runs ``script`` (of the page at ``path``) as ``python FILE`` in a fresh
    directory, as a user would, without the tests' own settings."""
    env = {}
    if devices:
        flags = os.environ.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}"
    return run_script(
        script,
        env=env,
        unset=package_settings(),
        timeout=600,
        forked=True,
        name=f"{path.stem}_md.py",
    )


def block_outputs(stdout: str) -> dict[int, str]:
    """What each block printed: its page line -> its stdout (0: before any)."""
    parts = re.split(r"\x1edoc-block (\d+)\x1e\n", stdout)
    outputs = {0: parts[0]} if parts[0] else {}
    for line, text in zip(parts[1::2], parts[2::2], strict=True):
        outputs[int(line)] = text
    return outputs


@functools.cache
def _page_run(path: pathlib.Path):
    return run_page(path, page_script(path))


def _check_printed(path, block, outputs, proc) -> None:
    name = f"{path.relative_to(ROOT)}:{block['line']}"
    assert block["line"] in outputs, (
        f"{name} did not run: the script stopped before it (exit status "
        f"{proc.returncode}):\n{proc.stderr[-3000:]}"
    )
    got = outputs[block["line"]]
    last = max(outputs) == block["line"]
    assert proc.returncode == 0 or not last, (
        f"{name} failed (exit status {proc.returncode}):\n{proc.stderr[-3000:]}"
    )
    want = expected_output(path, block)
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    if not want:
        assert not got, (
            f"{name} prints what the page does not show; add the output (a text "
            f"block marked <!-- test: output -->, or '# prints:' comments):\n{got}"
        )
        return
    assert checker.check_output(
        jax_params_dropped(want), jax_params_dropped(got), flags
    ), f"{name}: the page says it prints\n{want}\nbut it prints now:\n{got}"


@pytest.mark.parametrize(
    "path,block",
    PY_BLOCKS,
    ids=[f"{p.relative_to(ROOT)}:{b['line']}" for p, b in PY_BLOCKS],
)
def test_doc_block_runs(path, block):
    """The block ran, as part of its page's script, and printed what is shown."""
    reason = _skip_reason(block)
    if reason:
        pytest.skip(reason)
    if _own_script(block):
        proc = run_page(path, page_script(path, last=block), _devices(block))
    else:
        proc = _page_run(path)
    _check_printed(path, block, block_outputs(proc.stdout), proc)
    if _own_script(block):
        _check_stderr(f"{path.relative_to(ROOT)}:{block['line']}", proc)
    if needs_alone_run(path, block):
        alone = run_page(path, alone_script(block))
        name = f"{path.relative_to(ROOT)}:{block['line']}"
        assert alone.returncode == 0, (
            f"{name} fails when pasted alone into a fresh file; make it a complete "
            f"script, or start it with {pages.CONTINUES!r}:\n{alone.stderr[-3000:]}"
        )
        _check_printed(path, block, block_outputs(alone.stdout), alone)
        _check_stderr(f"{name} (alone)", alone)


def _check_stderr(name: str, proc) -> None:
    assert not proc.stderr, f"{name}: the script wrote to stderr:\n{proc.stderr}"


PAGES = sorted({p for p, b in PY_BLOCKS if not _skip_reason(b) and not _own_script(b)})


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_doc_page_runs_as_a_script(path):
    """The page's blocks, pasted in order into one file, run with empty stderr."""
    proc = _page_run(path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_stderr(str(path.relative_to(ROOT)), proc)


def test_a_page_starts_with_a_block_that_continues_nothing():
    for path in FILES:
        found = [b for b in blocks(path) if pages.in_page_script(b)]
        assert not found or not pages.continues(found[0]), (
            f"{path.relative_to(ROOT)}:{found[0]['line']}: the page's first "
            "example continues nothing above it"
        )


def test_whole_page_script_for_a_page_whose_blocks_continue(tmp_path):
    first = "```python\nimport math\nx = 2\n```\n"
    second = f"```python\n{pages.CONTINUES}\nprint(math.sqrt(x))\n```\n"
    alone = "<!-- test: alone -->\n```python\nprint(1)\n```\n"
    page = f"# P\n\n{first}\ntext\n\n{alone}\n{second}"
    assert pages.whole_script(page) == "import math\nx = 2\n\nprint(math.sqrt(x))\n"
    assert pages.whole_script(f"# P\n\n{first}\n{alone}") is None
    shown = pages.on_page_markdown(page, page=None, config=None, files=None)
    assert shown.startswith(page.rstrip())
    assert pages.HEADING in shown and shown.endswith("print(math.sqrt(x))\n```\n")
    path = tmp_path / "page.md"
    path.write_text(page)
    proc = run_page(path, pages.whole_script(page))
    assert (proc.returncode, proc.stdout) == (0, "1.4142135623730951\n")


def test_measured_output_matches_any_number(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint('8 shards: 0.2 s')\n```\n\n"
        "<!-- test: output measured -->\n```text\n8 shards: 0.21 s\n```\n"
    )
    (block, _) = blocks(page)
    assert expected_output(page, block) == "... shards: ... s\n"


def test_block_outputs_are_split_by_block():
    out = _sentinel(3) + "a\n" + _sentinel(9) + _sentinel(12) + "b\nc\n"
    assert block_outputs(out) == {3: "a\n", 9: "", 12: "b\nc\n"}
    assert block_outputs("x\n" + _sentinel(3)) == {0: "x\n", 3: ""}


def test_page_script_keeps_the_page_line_numbers():
    path = ROOT / "docs" / "api-threadmap.md"
    script = page_script(path).splitlines()
    (block,) = [b for p, b in PY_BLOCKS if p == path]
    assert _sentinel(block["line"]).strip() in script[block["line"] - 1]
    assert script[block["line"] :] == block["code"].splitlines()


def test_expected_output_from_a_text_block_or_prints_comments(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nprint(1)  # prints: 1\nprint(2)  # prints: 2\n```\n\n"
        "```python\nprint(3)\n```\n\n<!-- test: output -->\n```text\n3\n```\n"
        "```python\nx = 1\n```\n"
    )
    first, second, _, third = blocks(page)
    assert expected_output(page, first) == "1\n2\n"
    assert expected_output(page, second) == "3\n"
    assert expected_output(page, third) == ""


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
    it, so that it may also stand for nothing once params are dropped. Lines
    before the jaxpr (what the block printed first) are kept as they are, and text
    without a jaxpr is returned as it is.
    """
    start = re.search(r"^\s*\{ lambda ", text, re.MULTILINE)
    if start is None:
        return text
    lines, open_eqns = text[: start.start()].splitlines(), []
    for line in text[start.start() :].splitlines():
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


def test_every_page_has_blocks_that_parse():
    assert PY_BLOCKS, "no Python blocks found"
    for path, b in PY_BLOCKS:
        compile(b["code"], f"{path.name}:{b['line']}", "exec")


def test_no_table_has_an_empty_header_row():
    # A table's first row names its columns (an empty one renders as a grey bar).
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines[1:], 1):
            if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):
                cells = lines[i - 1].strip().strip("|").split("|")
                assert any(c.strip() for c in cells), f"{path.name}:{i}: {lines[i - 1]}"


def test_readme_has_exactly_the_two_commands_that_ci_runs():
    # "The two commands": the README's first shell blocks, one line each; the
    # docs section's block (the browser check) comes after them.
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## The two commands", 1)[1].split("\n## ", 1)[0]
    shell = [b for b in pages.blocks(section) if b["lang"] == "bash"]
    assert [len(b["code"].splitlines()) for b in shell] == [1, 1]
    first = [b for b in blocks(ROOT / "README.md") if b["lang"] == "bash"][:2]
    assert [b["code"] for b in first] == [b["code"] for b in shell]
    demo, tests = (b["code"] for b in shell)
    assert demo.endswith("-m examples.demo")
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests.split("&& ")[-1] in ci


def test_home_page_has_the_install_command_and_the_readme_numbers():
    home, readme = (ROOT / "docs" / "index.md").read_text(), (ROOT / "README.md")
    region = re.compile(
        r"<!-- benchmarks:headline -->.*?<!-- /benchmarks:headline -->", re.S
    )
    # benchmarks/report.py --write-docs rewrites both from the same results.
    assert region.search(home)[0] == region.search(readme.read_text())[0]
    assert "| trivial `x + 1` |" in region.search(home)[0]
    shell = [
        b["code"] for b in blocks(ROOT / "docs" / "index.md") if b["lang"] == "bash"
    ]
    assert "python3 -m venv .venv && .venv/bin/pip install -q ." in shell


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
    # A block that prints other lines first, then the jaxpr: the jaxpr part too.
    printed = "8\nTrue True\n"
    assert jax_params_dropped(printed + old) == printed + jax_params_dropped(new)


SHELL = ("bash", "sh", "shell", "console")
#: A command's program: python, pip, pytest or mkdocs, with the path it is run by.
_TOOL = re.compile(
    r"(?<![\w./-])(?P<path>[\w./-]*/)?(?P<tool>python3?|pip3?|pytest|mkdocs)"
    r"(?![\w.-])(?P<rest>[^\n]*)"
)
#: What a command runs -> the extras of which it needs one (pyproject.toml).
NEEDS = [
    (re.compile(r"\bpytest\b"), {"test"}),
    (re.compile(r"benchmarks/test_bench_|pytest benchmarks"), {"bench"}),
    (re.compile(r"\bexamples[./](?!demo\b)|gridding"), {"examples"}),
    (re.compile(r"--plot"), {"plot", "examples"}),
    (re.compile(r"\bmkdocs\b"), {"docs"}),
    (re.compile(r"\bdask\b"), {"dask", "test"}),
]
_EXTRAS = re.compile(
    r"""\.venv/bin/pip install [^\n]*?["']\.\[(?P<names>[\w,]+)\]["']"""
)


def installed_extras(code: str) -> set[str]:
    """The extras that ``code`` installs with ``.venv/bin/pip install``."""
    return {e for m in _EXTRAS.finditer(code) for e in m["names"].split(",")}


def pyproject_extras() -> set[str]:
    """The extras that pyproject.toml defines."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = \[", table, re.M))


def shell_block_problems(
    code: str, extras: set[str], installed_above: frozenset[str] = frozenset()
) -> list[str]:
    """Why a shell block would not run as written after the README's set-up.

    ``installed_above``: the extras that the page's shell blocks above install.
    """
    problems = []
    for m in _TOOL.finditer(code):
        venv = m["path"] == ".venv/bin/"
        makes_venv = m["tool"] == "python3" and m["rest"].startswith(" -m venv .venv")
        if not venv and not makes_venv:
            problems.append(
                f"{(m['path'] or '') + m['tool']!r}: the README set up .venv, so "
                f"write .venv/bin/{m['tool']}"
            )
    installed = installed_extras(code)
    unknown = sorted(installed - extras)
    if unknown:
        problems.append(f"installs extras that pyproject.toml lacks: {unknown}")
    runs = "\n".join(m[0] for m in _TOOL.finditer(code) if "pip" not in m["tool"])
    for pattern, wanted in NEEDS:
        if pattern.search(runs) and not wanted & (installed | installed_above):
            problems.append(
                f"runs {pattern.search(runs)[0]!r}, which needs the extra "
                f"{' or '.join(sorted(wanted))}: add .venv/bin/pip install -q "
                f'".[{sorted(wanted)[0]}]" to the block'
            )
    return problems


#: Pages with commands: the docs, and how to run the benchmarks.
COMMAND_FILES = [*FILES, ROOT / "benchmarks" / "README.md"]
SHELL_BLOCKS = [(p, b) for p in COMMAND_FILES for b in blocks(p) if b["lang"] in SHELL]


@pytest.mark.parametrize(
    "path,block",
    SHELL_BLOCKS,
    ids=[f"{p.relative_to(ROOT)}:{b['line']}" for p, b in SHELL_BLOCKS],
)
def test_shell_block_runs_after_the_readme_set_up(path, block):
    above = [b for p, b in SHELL_BLOCKS if p == path and b["line"] < block["line"]]
    installed = frozenset().union(*(installed_extras(b["code"]) for b in above))
    problems = shell_block_problems(block["code"], pyproject_extras(), installed)
    assert not problems, f"{path.relative_to(ROOT)}:{block['line']}: {problems}"


#: Inline code that is a command: its environment variables, then the program.
_INLINE_COMMAND = re.compile(
    r"`((?:[A-Z0-9_]+=\S+ )*(?:[\w./-]*/)?(?:python3?|pip3?|pytest|mkdocs)\s[^`]*)`"
)


def test_inline_commands_use_the_readme_venv():
    found = []
    for path in COMMAND_FILES:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for command in _INLINE_COMMAND.findall(text):
            if any(
                ".venv/bin/" not in m[0] and not m[0].startswith("python3 -m venv")
                for m in _TOOL.finditer(command)
            ):
                found.append(f"{path.relative_to(ROOT)}: {command}")
    assert not found, "commands not run by .venv/bin/ (README's set-up):\n" + "\n".join(
        found
    )


def test_shell_block_check_finds_what_a_block_needs():
    extras = pyproject_extras()
    assert {"test", "docs", "examples", "bench"} <= extras
    examples = '.venv/bin/pip install -q ".[examples]"'
    run = ".venv/bin/python -m examples.gridding"
    assert shell_block_problems(f"{examples}\n{run}", extras) == []
    assert shell_block_problems(run, extras, frozenset({"examples"})) == []
    assert (
        shell_block_problems(
            "python3 -m venv .venv && .venv/bin/pip install -q . && "
            ".venv/bin/python -m jax_threadmap",
            extras,
        )
        == []
    )
    (bare,) = shell_block_problems("python benchmarks/accelerator.py", extras)
    assert "write .venv/bin/python" in bare
    (needs,) = shell_block_problems(
        ".venv/bin/python -m examples.gridding.newton", extras
    )
    assert "needs the extra examples" in needs
    problems = shell_block_problems(
        '.venv/bin/pip install -q ".[tests]"\n.venv/bin/pytest tests', extras
    )
    assert any("lacks: ['tests']" in p for p in problems), problems
    assert any("needs the extra test" in p for p in problems), problems
    assert shell_block_problems("pip install ducc0", extras)
    assert not shell_block_problems('.venv/bin/pip install -q "jax[tpu]"', extras)


#: A command that installs into the README's ``.venv``: its arguments.
_INSTALL = re.compile(r"\.venv/bin/pip install ([^\n`&;|]*)")
#: Modules that come with a distribution of another name: ``examples`` is this
#: repository's folder of examples, which needs ducc0 (the ``examples`` extra).
_DISTRIBUTION = {"distributed": "dask", "examples": "ducc0"}


def _requirement(spec: str) -> str:
    """The distribution that a requirement names: ``dask[distributed]>=1`` -> dask."""
    return re.match(r"[\w.-]+", spec)[0].lower()


def extra_requirements() -> dict[str, set[str]]:
    """Each extra of pyproject.toml -> the distributions it installs."""
    text = (ROOT / "pyproject.toml").read_text()
    table = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    lists = re.finditer(r"^([\w-]+) = \[(.*?)\]\s*$", table, re.M | re.S)
    return {
        m[1]: {_requirement(s) for s in re.findall(r'"([^"]+)"', m[2])} for m in lists
    }


def base_modules() -> set[str]:
    """What a block may import after ``pip install .``: the package and its deps."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]\s*$", text, re.M | re.S)[1]
    return {"jax_threadmap"} | {_requirement(s) for s in re.findall(r'"([^"]+)"', deps)}


def installs_before(text: str, line: int) -> set[str]:
    """The distributions that the page's install commands above ``line`` install."""
    extras = extra_requirements()
    found: set[str] = set()
    for args in _INSTALL.findall("\n".join(text.splitlines()[: line - 1])):
        for arg in args.replace('"', " ").replace("'", " ").split():
            if m := re.fullmatch(r"\.\[([\w,-]+)\]", arg):
                found |= set().union(*(extras.get(e, set()) for e in m[1].split(",")))
            elif re.match(r"[A-Za-z]", arg):  # not an option, not "."
                found.add(_requirement(arg))
    return found


def unstated_imports(text: str, block: dict) -> list[str]:
    """The modules ``block`` imports that neither come with ``pip install .`` nor
    are installed by a command the page shows above it."""
    imported = re.findall(r"^\s*(?:import|from)\s+(\w+)", block["code"], re.M)
    stated = base_modules() | installs_before(text, block["line"])
    return sorted(
        {
            m
            for m in imported
            if m not in sys.stdlib_module_names
            and _DISTRIBUTION.get(m, m) not in stated
        }
    )


@pytest.mark.parametrize(
    "path,block",
    PY_BLOCKS,
    ids=[f"{p.relative_to(ROOT)}:{b['line']}" for p, b in PY_BLOCKS],
)
def test_doc_block_says_how_to_install_what_it_imports(path, block):
    # Was: docs/threaded-kernels.md imported scipy and docs/async-kernels.md
    # aiohttp, which `pip install .` does not install, and said nothing of either.
    unstated = unstated_imports(path.read_text(), block)
    assert not unstated, (
        f"{path.relative_to(ROOT)}:{block['line']} imports {unstated}, which the "
        "README's set-up does not install: say how above it on the page "
        '(.venv/bin/pip install -q ".[EXTRA]" or the package)'
    )


def test_install_check_finds_what_a_page_does_not_install():
    block = {"line": 3, "code": "import scipy.fft\nimport numpy\nimport os"}
    assert unstated_imports("# P\n\n```python", block) == ["scipy"]
    page = "Needs SciPy (`.venv/bin/pip install -q scipy`).\n\n```python"
    assert unstated_imports(page, block) == []
    page = 'Needs (`.venv/bin/pip install -q ".[bench]"`).\n\n```python'
    assert unstated_imports(page, block) == []
    # An install below the block does not count; nor does another extra.
    assert unstated_imports("# P\n\n```python\n.venv/bin/pip install scipy", block)
    assert unstated_imports('`.venv/bin/pip install -q ".[docs]"`\n\n```', block)
    dask = {"line": 3, "code": "from distributed import Client\nimport examples"}
    page = '`.venv/bin/pip install -q ".[dask,examples]"`\n\n```python'
    assert unstated_imports(page, dask) == []
    assert unstated_imports('`.venv/bin/pip install -q ".[dask]"`\n\n', dask) == [
        "examples"
    ]
