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
import statistics
import subprocess
import sys

import pytest

import jax_threadmap

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
            continue  # threadmap_p, a Primitive instance: docs/api-threadmap.md
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
REQUIRED = os.environ.get("JAX_THREADMAP_TEST_SITE") == "required"


def _skip(reason: str) -> None:
    if REQUIRED:
        pytest.fail(f"{reason}, and JAX_THREADMAP_TEST_SITE=required")
    pytest.skip(reason)


def readme_docs_command() -> tuple[dict[str, str], list[str]]:
    """The environment and arguments of README's ``mkdocs build --strict``."""
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"`((?:\w+=\S+ )*)\.venv/bin/mkdocs build --strict`", readme)
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
            _skip(f"{module} is not installed (.venv/bin/pip install -q '.[docs]')")
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
        _skip("playwright is not installed (.venv/bin/pip install -q '.[browser]')")
    path = shutil.which("chromium") or browser_check.CHROMIUM
    if not pathlib.Path(path).exists():
        _skip(f"no Chromium at {path} (apt-get install chromium; README.md)")
    return path


def api_pages(site: pathlib.Path) -> dict[str, str]:
    """The API reference's pages (``api``, ``api-threadmap``, ...): name -> HTML."""
    found = {p.parent.name: p.read_text() for p in site.glob("api*/index.html")}
    assert {"api", "api-threadmap", "api-errors"} <= set(found), sorted(found)
    return found


def test_api_pages_render_examples_as_code_and_no_roles(site):
    pages = api_pages(site)
    text = _Text()
    for page in pages.values():
        text.feed(page)
    code, prose = "".join(text.code), "".join(text.prose)
    roles = sorted(set(_ROLE.findall(prose)))
    assert not roles, f"literal Sphinx roles on the API pages: {roles}"
    examples = doc_examples()
    assert len(examples) > 40, "the docstring examples were not found"
    for name, line in examples:
        assert line in code, f"{name}: example line not in a code block: {line!r}"
        assert line not in prose, f"{name}: example line shown as prose: {line!r}"
    # Highlighted as Python sessions: every example line has its prompt.
    prompts = sum(p.count('class="gp">&gt;&gt;&gt; </span>') for p in pages.values())
    assert prompts >= len(examples)
    assert not any("<blockquote>" in p for p in pages.values()), "a block quote"
    assert "[jax_threadmap." not in prose, "an unresolved cross-reference"


def test_api_reference_documents_every_public_object_once(site):
    # One page per group of what a user does; each object on exactly one of them,
    # and the overview links to each.
    pages = api_pages(site)
    where = {}
    for name, page in pages.items():
        for obj in _ROOT_HEADING.findall(page):
            assert obj not in where, f"{obj} on both {where[obj]} and {name}"
            where[obj] = name
    public = [n for n in jax_threadmap.__all__ if n != "threadmap_p"]
    assert sorted(where) == sorted(public)
    for obj, name in where.items():
        assert f'href="../{name}/#jax_threadmap.{obj}"' in pages["api"], obj


_ROOT_HEADING = re.compile(r'<h2 id="jax_threadmap\.(\w+)" class="doc doc-heading')
_HEADING = re.compile(r'<h[23] id="jax_threadmap\.([\w.]+)" class="doc doc-heading')


_ANY_HEADING = re.compile(r"<h[1-3] id=")


def api_sections(page: str) -> dict[str, str]:
    """An API page's HTML per documented object, from its heading to the next."""
    found = list(_HEADING.finditer(page))
    sections = {}
    for m in found:
        following = _ANY_HEADING.search(page, m.end())
        end = following.start() if following else page.index("</article>")
        sections[m[1]] = page[m.start() : end]
    return sections


def test_api_page_shows_one_readable_signature_per_object(site):
    # Was: threadmap, kernel and async_call showed their four @overload blocks
    # (two of them Any -> Any) before any prose, a private `_Arrays` return type,
    # `executor: Executor = None`, `defvjp(vjp: F, *unexpected: object) -> F`, and
    # Returns as tables splitting one sentence over two rows typed Any.
    pages = api_pages(site)
    sections = {k: v for page in pages.values() for k, v in api_sections(page).items()}
    assert {"threadmap", "kernel", "async_call", "KernelFunction.defvjp"} <= set(
        sections
    )
    for name, section in sections.items():
        assert "doc-overloads" not in section, f"{name}: its overloads are listed"
        assert section.count('class="doc-signature') <= 1, f"{name}: signatures"
        assert "<table" not in section, f"{name}: a section rendered as a table"
    text = _Text()
    for page in pages.values():
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
    heights = {}
    problems = browser_check.check_site(site, chromium=chromium, heights=heights)
    assert not problems, "\n".join(problems)
    # Every page of the built site, at both widths (the API reference's and the
    # async arrays' pages among them).
    pages = browser_check.site_pages(site)
    assert sorted(heights) == pages and len(pages) >= 25, pages
    assert {"api/", "api-threadmap/", "async/", "async-dispatch/"} <= set(pages)
    assert all(sorted(h) == [390, 1280] for h in heights.values())
    # Was: the API page 40,000 px tall on a phone and the async arrays page 39,000,
    # over five times the median page: pages a reader cannot hold, now split by
    # task, one question a page. (The tallest now, derivatives/, is 3.6 times.)
    phone = {path: h[390] for path, h in heights.items()}
    median = statistics.median(phone.values())
    tall = {path: px for path, px in phone.items() if px > 5 * median}
    assert not tall, f"over 5 x the median page ({median:.0f} px at 390 px): {tall}"


def write_site(root: pathlib.Path, pages: dict[str, str]) -> None:
    """A site of ``pages`` (path -> HTML) under ``root``, each an ``index.html``."""
    for path, text in pages.items():
        (root / path).mkdir(parents=True, exist_ok=True)
        (root / path / "index.html").write_text(text)


_FINE = "<html><body><p>fine</p></body></html>"


def test_browser_check_finds_a_broken_image_and_a_console_error(chromium, tmp_path):
    bad = (
        '<html><body><img src="missing.png">'
        '<script>console.error("broken script")</script>'
        "<p>costs $x^2$ (no blank line around the formula)</p></body></html>"
    )
    write_site(tmp_path, {"": _FINE, "bad/": bad, "deep/er/": _FINE})
    heights = {}
    problems = browser_check.check_site(
        tmp_path, chromium=chromium, search=False, heights=heights
    )
    for width in (1280, 390):
        assert any(
            "/bad/: broken image" in p and "missing.png" in p and f"({width} px)" in p
            for p in problems
        ), problems
        # Loaded once (at 1280 px), then narrowed: its console errors once.
        assert any(
            "/bad/: maths left as TeX:" in p
            and "costs $x^2$ (no blank" in p
            and f"({width} px)" in p
            for p in problems
        ), problems
    assert any(
        "/bad/: console error: HTTP 404: " in p
        and p.endswith("/bad/missing.png (at 1280 px, then 390 px)")
        for p in problems
    ), problems
    script = [p for p in problems if "console error: broken script" in p]
    assert len(script) == 1, problems
    assert script[0].endswith(
        "/bad/: console error: broken script (at 1280 px, then 390 px)"
    )
    assert all("/bad/" in p for p in problems), problems
    # Every page of the site, found from its files, at both widths.
    assert sorted(heights) == ["", "bad/", "deep/er/"]
    assert all(
        sorted(h) == [390, 1280] and min(h.values()) > 0 for h in heights.values()
    )


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
    write_site(tmp_path, {"": _FINE, "api/": _FINE, "cut/": cut})
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


def test_browser_check_finds_overflow_and_inline_code_broken_in_a_word(
    chromium, tmp_path
):
    # As on the site before docs/hooks/inline_code.py: inline code broken anywhere
    # (`--size` as `-` / `-size`), a 3-column table wider than the phone's text
    # column, and something wider than the screen.
    style = "<style>.tok { white-space: nowrap }</style>"
    broken = (
        f"<html><head>{style}</head><body>"
        '<p style="width: 40px"><code style="word-break: break-all">--size</code></p>'
        "</body></html>"
    )
    # Breaks where the hook allows them: between words and after a "." of a long
    # word; a 5-column table that scrolls in its own box on a phone.
    scrolled = "".join(f"<td>{'x' * 40}</td>" for _ in range(5))
    allowed = (
        f"<html><head>{style}</head><body>"
        '<p style="width: 120px"><code><span class="tok">aa</span> '
        '<span class="tok">bb</span> <span class="tok">jax.<wbr>experimental.'
        '<wbr>transfer</span></code></p><div class="md-typeset__scrollwrap" '
        f'style="width: 300px; overflow: auto"><table><tr>{scrolled}</tr></table>'
        "</div></body></html>"
    )
    wide = (
        "<html><body>"
        '<div class="md-typeset__scrollwrap" style="width: 300px; overflow: auto">'
        "<table><tr><td>a</td><td>b</td><td>" + "y" * 80 + "</td></tr></table>"
        # As the theme lays a table out: it scrolls inside itself, its box fits.
        '</div><div style="width: 300px"><table style="display: inline-block; '
        'max-width: 100%; overflow: auto"><tr><td>a</td><td>' + "z" * 80 + "</td>"
        '</tr></table></div><div style="width: 1500px">wide</div></body></html>'
    )
    # Wider than a phone, not than a desktop: a page checked at 390 px after it was
    # loaded at 1280 px.
    phone = '<html><body><div style="width: 600px">wide</div></body></html>'
    write_site(
        tmp_path,
        {"": _FINE, "broken/": broken, "allowed/": allowed, "wide/": wide}
        | {"phone/": phone},
    )
    problems = browser_check.check_site(tmp_path, chromium=chromium, search=False)
    for width in (1280, 390):
        assert any(
            "/broken/: inline code broken inside a word: --size" in p
            and f"({width} px)" in p
            for p in problems
        ), problems
        for columns in (3, 2):
            assert any(
                "/wide/: table" in p
                and f"({columns} columns)" in p
                and f"({width} px)" in p
                for p in problems
            ), problems
        assert any(
            "/wide/: the page scrolls sideways by" in p and f"({width} px)" in p
            for p in problems
        ), problems
    phone = [p.split("/phone/: ")[1] for p in problems if "/phone/" in p]
    assert len(phone) == 1, problems
    assert phone[0].startswith("the page scrolls sideways by "), problems
    assert phone[0].endswith(" px (390 px)"), problems
    # The 5 columns may scroll on a phone, not on a desktop.
    assert (
        [p for p in problems if "/allowed/" in p]
        == [p for p in problems if "/allowed/: table" in p and "(1280 px)" in p]
        != []
    ), problems


def test_inline_code_hook_keeps_words_whole_but_not_code_blocks():
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    import inline_code

    html = (
        "<p><code>--size x</code> <pre><code>a b</code></pre><code>"
        '<a href="#">jax.Array</a>.at[i].set(jax.experimental.transfer.x)</code>'
        "</p><table><tr><td><code>np.linalg.eigvalsh</code></td></tr></table>"
    )
    # A break leaves 3 characters or more on each side: none before ".at", none
    # before "x)".
    assert inline_code.words_kept_whole(html) == (
        '<p><code><span class="tok">--size</span> <span class="tok">x</span></code>'
        ' <pre><code>a b</code></pre><code><a href="#"><span class="tok">jax.Array'
        '</span></a><span class="tok">.at[i].<wbr>set(<wbr>jax.<wbr>experimental.'
        "<wbr>transfer.x)</span></code></p><table><tr><td><code>"
        '<span class="tok">np.<wbr>linalg.<wbr>eigvalsh</span></code></td></tr></table>'
    )


def test_site_keeps_inline_code_words_whole(site):
    page = (site / "getting-started" / "index.html").read_text()
    assert '<span class="tok">--size</span>' in page
