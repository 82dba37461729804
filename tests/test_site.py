"""The docs site as a reader sees it: the API reference renders, the pages work.

The API reference is built from the public docstrings by mkdocstrings. Google
style needs ``Examples:`` (plural): griffe reads ``Example:`` as an admonition
and renders the doctest as a paragraph in nested block quotes. Sphinx roles
(``:func:`x```) are not mkdocstrings syntax and show up as literal text; the
cross-references are ``[name][jax_threadmap.name]`` (links checked by
``mkdocs build --strict``). The site tests need the ``docs`` extra (mkdocs), the
browser test also the ``browser`` extra (playwright) and a Chromium.
"""

from __future__ import annotations

import doctest
import html.parser
import importlib.util
import inspect
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import jax_threadmap

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import browser_check  # noqa: E402

# Runs in child processes on the CPU (conftest.py, tests/tpu_suite.sh).
pytestmark = pytest.mark.children

_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|attr|mod|exc|data|obj|ref):`")


def public_docstrings() -> dict[str, str]:
    """The docstrings the API page shows: public objects and their members."""
    found = {}
    for name in jax_threadmap.__all__:
        obj = getattr(jax_threadmap, name)
        if inspect.getmodule(obj) is None or not obj.__doc__:
            continue  # threadmap_p, a Primitive instance: docs/api.md
        found[name] = obj.__doc__
        for attr, member in vars(obj).items() if inspect.isclass(obj) else ():
            member = getattr(member, "__func__", member)  # classmethods
            if not attr.startswith("_") and getattr(member, "__doc__", None):
                found[f"{name}.{attr}"] = member.__doc__
    return found


def doc_examples() -> list[tuple[str, str]]:
    """(object, first line of source) of every docstring example of the API."""
    found = []
    for name in jax_threadmap.__all__:
        obj = getattr(jax_threadmap, name)
        module = inspect.getmodule(obj)
        for test in doctest.DocTestFinder().find(obj, name, module=module, globs={}):
            found += [(test.name, ex.source.splitlines()[0]) for ex in test.examples]
    return found


@pytest.mark.parametrize("name,doc", sorted(public_docstrings().items()))
def test_public_docstrings_use_mkdocstrings_syntax(name, doc):
    assert not _ROLE.search(doc), (
        f"{name}: a Sphinx role, shown as literal text by mkdocstrings; write "
        f"[`obj`][jax_threadmap.obj] (or a link for JAX and Python objects): "
        f"{_ROLE.search(doc).group()!r}"
    )
    assert not re.search(r"^\s*Example:\s*$", doc, re.M), (
        f"{name}: 'Example:' is read as an admonition; the section is 'Examples:'"
    )


def test_every_public_object_has_examples():
    names = {name for name, _ in doc_examples()}
    lacking = [
        n for n in jax_threadmap.__all__ if n not in names and n != "threadmap_p"
    ]
    assert not lacking, f"public objects without an Examples section: {lacking}"


class _Text(html.parser.HTMLParser):
    """The text of a page, split into what is inside ``<pre>`` and the rest."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.code: list[str] = []
        self.prose: list[str] = []
        self.depth = 0

    def handle_starttag(self, tag, attrs):
        self.depth += tag == "pre"

    def handle_endtag(self, tag):
        self.depth -= tag == "pre"

    def handle_data(self, data):
        (self.code if self.depth else self.prose).append(data)


#: Set by .ci/run: where CI installed the docs and browser extras and Chromium,
#: a site test that cannot run fails instead of skipping.
REQUIRED = os.environ.get("JAX_THREADMAP_SITE_TESTS") == "required"


def _skip(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"{reason}, and JAX_THREADMAP_SITE_TESTS=required")
    pytest.skip(reason)


def readme_docs_command() -> tuple[dict[str, str], list[str]]:
    """The environment and arguments of README's ``mkdocs build --strict``."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"`((?:\w+=\S+ )*)mkdocs build --strict`", readme)
    assert command, "README: no `mkdocs build --strict` command"
    env = {k: v for k, v in os.environ.items() if k != "NO_MKDOCS_2_WARNING"}
    env.update(kv.split("=", 1) for kv in command[1].split())
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p
    )
    return env, [sys.executable, "-m", "mkdocs", "build", "--strict"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[pathlib.Path, subprocess.CompletedProcess]:
    """The site, built once with README's command; and that command's run."""
    for module in ("mkdocs", "mkdocstrings", "material"):
        if importlib.util.find_spec(module) is None:
            _skip(f"{module} is not installed (pip install '.[docs]')")
    site_dir = tmp_path_factory.mktemp("site")
    env, command = readme_docs_command()
    proc = subprocess.run(
        [*command, "--site-dir", str(site_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return site_dir, proc


@pytest.fixture(scope="module")
def site(built) -> pathlib.Path:
    return built[0]


@pytest.fixture(scope="module")
def chromium() -> str:
    """The Chromium executable for playwright; skips where there is none."""
    if importlib.util.find_spec("playwright") is None:
        _skip("playwright is not installed (pip install '.[browser]')")
    path = shutil.which("chromium") or browser_check.CHROMIUM
    if not pathlib.Path(path).exists():
        _skip("no Chromium (apt-get install chromium)")
    return path


def test_api_page_renders_examples_as_code_and_no_roles(site):
    page = (site / "api" / "index.html").read_text()
    text = _Text()
    text.feed(page)
    code, prose = "".join(text.code), "".join(text.prose)
    roles = sorted(set(_ROLE.findall(prose)))
    assert not roles, f"literal Sphinx roles on the API page: {roles}"
    examples = doc_examples()
    assert len(examples) > 40, "the docstring examples were not found"
    for name, line in examples:
        assert line in code, f"{name}: example line not in a code block: {line!r}"
        assert line not in prose, f"{name}: example line shown as prose: {line!r}"
    # Highlighted as Python sessions: every example line has its prompt.
    assert page.count('class="gp">&gt;&gt;&gt; </span>') >= len(examples)
    assert "<blockquote>" not in page, "a doctest rendered as a block quote"
    assert "[jax_threadmap." not in prose, "an unresolved cross-reference"


_HEADING = re.compile(r'<h[23] id="jax_threadmap\.([\w.]+)" class="doc doc-heading')


def api_sections(page: str) -> dict[str, str]:
    """The API page's HTML per documented object, from its heading to the next."""
    found = list(_HEADING.finditer(page))
    ends = [m.start() for m in found[1:]] + [page.index('id="threadmap_p"')]
    return {m[1]: page[m.start() : end] for m, end in zip(found, ends, strict=True)}


def test_api_page_shows_one_readable_signature_per_object(site):
    # Was: threadmap, kernel and async_call showed their four @overload blocks
    # (two of them Any -> Any) before any prose, a private `_Arrays` return type,
    # `executor: Executor = None`, `defvjp(vjp: F, *unexpected: object) -> F`, and
    # Returns as tables splitting one sentence over two rows typed Any.
    page = (site / "api" / "index.html").read_text()
    sections = api_sections(page)
    assert {"threadmap", "kernel", "async_call", "KernelFunction.defvjp"} <= set(
        sections
    )
    for name, section in sections.items():
        assert "doc-overloads" not in section, f"{name}: its overloads are listed"
        assert section.count('class="doc-signature') <= 1, f"{name}: signatures"
        assert "<table" not in section, f"{name}: a section rendered as a table"
    text = _Text()
    text.feed(page)
    shown = "".join(text.code) + "".join(text.prose)
    private = sorted(set(re.findall(r"(?<![\w.])_[A-Za-z]\w*", shown)))
    assert not private, f"private names on the API page: {private}"
    assert "unexpected" not in shown
    threadmap = _Text()
    threadmap.feed(sections["threadmap"])
    prose = " ".join("".join(threadmap.prose).split())
    assert (
        "executor (int | concurrent.futures.Executor | InOrder | None, default: None"
        in prose
    )
    assert (
        "Returns: A pytree of arrays with the structure of result_shape_dtypes; "
        "under vmap, each leaf gains the batch axes. Raises:" in prose
    )
    defvjp = _Text()
    defvjp.feed(sections["KernelFunction.defvjp"])
    # Its two forms (one VJP kernel; fwd and bwd with residuals) in one signature.
    signature = "defvjp(vjp_or_fwd, bwd=None, /, *, residuals=None)"
    assert signature in "".join(defvjp.code).replace("\n", "")


def test_the_readme_docs_command_prints_no_theme_banner(built):
    # Was: `mkdocs build --strict` as the README said printed the Material theme's
    # notice about its end of life, which CI hid with an environment variable.
    # The `site` every test here reads is built with that very command.
    proc = built[1]
    assert "Material for MkDocs" not in proc.stderr + proc.stdout, proc.stderr


def test_site_in_headless_chromium(site, chromium):
    problems = browser_check.check_site(site, chromium=chromium)
    assert not problems, "\n".join(problems)


def test_browser_check_finds_a_broken_image_and_a_console_error(chromium, tmp_path):
    good = "<html><body><p>fine</p></body></html>"
    bad = (
        '<html><body><img src="missing.png">'
        '<script>console.error("broken script")</script></body></html>'
    )
    pages = [good, bad] + [good] * (len(browser_check.PAGES) - 2)
    for path, text in zip(browser_check.PAGES, pages, strict=True):
        (tmp_path / path).mkdir(parents=True, exist_ok=True)
        (tmp_path / path / "index.html").write_text(text)
    problems = browser_check.check_site(tmp_path, chromium=chromium, search=False)
    assert any("broken image" in p and "missing.png" in p for p in problems)
    assert any("console error: broken script" in p for p in problems)
    assert all("/api/" in p for p in problems), problems


def test_browser_check_finds_cut_code_and_broken_table_words(chromium, tmp_path):
    # A code line wider than its block (the theme's default: scrolled, its end
    # hidden) and a table column too narrow for its word, as on the site before
    # docs/stylesheets/code.css; the rest of the site's pages are empty.
    cut = (
        '<html><body><pre style="width: 300px; overflow: auto"><code>'
        + "print('"
        + "x" * 80
        + "')</code></pre>"
        '<table style="width: 60px"><tr><td style="word-break: break-all">'
        "jax.block_until_ready(tree)</td><td>front-loaded</td></tr></table>"
        "</body></html>"
    )
    for path in [*browser_check.PAGES, "cut/"]:
        (tmp_path / path).mkdir(parents=True, exist_ok=True)
        page = cut if path == "cut/" else "<html><body><p>fine</p></body></html>"
        (tmp_path / path / "index.html").write_text(page)
    problems = browser_check.check_site(tmp_path, chromium=chromium, search=False)
    for width in (1280, 390):
        assert any(
            "/cut/: code line cut by" in p
            and "print('xxx" in p
            and f"({width} px)" in p
            for p in problems
        ), problems
        assert any(
            "/cut/: table breaks a word: jax.block_until_ready(tree)" in p
            and f"({width} px)" in p
            for p in problems
        ), problems
    assert all("/cut/" in p for p in problems), problems
    assert not any("front" in p or "loaded" in p for p in problems), problems
