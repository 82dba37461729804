"""Opens the built docs site in headless Chromium, as a reader would.

Serves the site on 127.0.0.1 (a port the OS picks), opens the home page, the API
reference and two guides, and fails on a console error (a script error, a resource
that did not load), a broken image, a formula that MathJax did not typeset, or a
search for "vmap" (typed into the search box of mkdocs-material) that finds
nothing. Every page, at a desktop's width (1280 px) and a phone's (390 px),
fails on a code line cut at the edge of its block (wider than the block, so
that its end is hidden) and on a word of a table broken in two (a break at a
hyphen is no such break). Nothing is fetched from
outside 127.0.0.1: a request elsewhere is blocked and counts as a failure, so
the site must work offline.

    python tests/browser_check.py                # builds the site first (mkdocs)
    python tests/browser_check.py --site site    # a site built already
    python tests/browser_check.py --screenshot api.png

Needs ``playwright`` (the ``browser`` extra) and a Chromium executable
(``apt-get install chromium``: ``/usr/bin/chromium``; ``--chromium PATH``).
Exit status 0 when every check passes; otherwise each failure is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.server
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
#: The pages opened: home, the API reference, a guide with images, and one with
#: maths (MathJax, served by the site itself).
PAGES = ["", "api/", "performance/", "gridding/"]
#: Opened again on a phone's width (the theme lays maths out differently there).
NARROW_PAGES = ["gridding/"]
NARROW = {"width": 390, "height": 844}
WIDE = {"width": 1280, "height": 1600}
SEARCH_TERM = "vmap"
#: Bounds every wait on the browser, in milliseconds.
TIMEOUT_MS = 30_000


def build_site(site_dir: pathlib.Path) -> None:
    """Builds the docs with ``mkdocs build --strict`` into ``site_dir``."""
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH")) if p
    )
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q"]
        + ["--site-dir", str(site_dir)],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=300,
    )


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        del format, args


@contextlib.contextmanager
def serve(site_dir: pathlib.Path) -> Iterator[str]:
    """Serves ``site_dir`` on 127.0.0.1; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


_BROKEN_IMAGES = """() => Array.from(document.images)
    .filter((img) => !img.complete || img.naturalWidth === 0)
    .map((img) => img.currentSrc || img.src)"""


#: Per code block wider than its box: by how much, and its longest line; per
#: word of a table cell that the layout breaks over two lines (its range has
#: boxes on two lines): the word.
_CUT = """() => {
    const cut = [];
    for (const code of document.querySelectorAll('pre > code')) {
        if (code.offsetParent === null) continue;  // hidden (a closed tab)
        const over = Math.max(...[code, code.parentElement]
            .filter((box) => box.clientWidth > 0)  // not an inline <code>
            .map((box) => box.scrollWidth - box.clientWidth));
        if (over > 1) {
            const lines = code.textContent.split('\\n');
            const longest = lines.reduce((a, b) => (b.length > a.length ? b : a));
            cut.push(`code line cut by ${over} px: ${longest.trim().slice(0, 70)}`);
        }
    }
    for (const cell of document.querySelectorAll('td, th')) {
        const texts = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
        while (texts.nextNode()) {
            const node = texts.currentNode;
            for (const word of node.textContent.matchAll(/[^\\s-]+/g)) {
                const range = document.createRange();
                range.setStart(node, word.index);
                range.setEnd(node, word.index + word[0].length);
                const tops = new Set(Array.from(range.getClientRects())
                    .filter((box) => box.width > 0).map((box) => Math.round(box.top)));
                if (tops.size > 1) cut.push(`table breaks a word: ${word[0]}`);
            }
        }
    }
    return cut;
}"""


def check_layout(page, url: str, problems: list[str]) -> None:
    """Opens ``url``; adds its cut code lines and broken table words."""
    page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
    problems.extend(f"{url}: {p}" for p in page.evaluate(_CUT))


def site_pages(site_dir: pathlib.Path) -> list[str]:
    """The paths of the site's pages (``""``, ``"api/"``, ...)."""
    found = (p.parent.relative_to(site_dir) for p in site_dir.rglob("index.html"))
    return sorted("" if p == pathlib.Path() else f"{p.as_posix()}/" for p in found)


def check_page(page, url: str, problems: list[str]) -> None:
    """Opens ``url``; adds its console errors and broken images to ``problems``."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.on(
        "requestfailed",
        lambda r: errors.append(f"request failed: {r.url} ({r.failure})"),
    )
    mathjax: list[str] = []
    page.on("request", lambda r: mathjax.append(r.url) if "tex-svg" in r.url else None)
    response = page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
    if response is None or not response.ok:
        problems.append(f"{url}: HTTP {response.status if response else 'none'}")
    problems.extend(f"{url}: console error: {e}" for e in errors)
    for src in page.evaluate(_BROKEN_IMAGES):
        problems.append(f"{url}: broken image {src}")
    problems.extend(f"{url}: {p}" for p in check_maths(page))
    if mathjax and not page.evaluate("document.querySelector('.arithmatex') !== null"):
        problems.append(f"{url}: loads MathJax (2 MB) but has no formula")


#: Per formula of the page (pymdownx.arithmatex's elements): its TeX, whether
#: MathJax typeset it (an SVG of some size), and whether MathJax reported an error.
_FORMULAS = """() => Array.from(document.querySelectorAll('.arithmatex')).map((el) => {
    const svg = el.querySelector('mjx-container > svg');
    const box = svg ? svg.getBoundingClientRect() : null;
    const shown = Boolean(box && box.width > 2 && box.height > 2);
    const error = Boolean(el.querySelector('[data-mjx-error], mjx-merror'));
    return [el.textContent.slice(0, 60), shown, error];
})"""


#: The prose of a page (no code, no typeset formula) where a "$" is left: maths that
#: pymdownx.arithmatex did not recognise (a "$$" block without blank lines around
#: it), shown as TeX source. The pages use no "$" otherwise.
_LEFT_AS_TEX = """() => {
    const page = document.querySelector('article') || document.body;
    const text = page.cloneNode(true);
    text.querySelectorAll('pre, code, .arithmatex').forEach((el) => el.remove());
    const prose = text.textContent.replace(/\\s+/g, ' ');
    return prose.match(/.{0,30}[$].{0,30}/g) || [];
}"""


def check_maths(page) -> list[str]:
    """Problems with the page's formulas: each must be typeset, without an error."""
    problems = [f"maths left as TeX: {t!r}" for t in page.evaluate(_LEFT_AS_TEX)]
    if not page.evaluate("document.querySelector('.arithmatex') !== null"):
        return problems
    try:  # MathJax loads asynchronously, then typesets the page
        page.wait_for_function(
            "() => window.MathJax && MathJax.startup && MathJax.startup.promise"
            " && document.querySelectorAll('.arithmatex mjx-container').length"
            " === document.querySelectorAll('.arithmatex').length",
            timeout=TIMEOUT_MS,
        )
    except Exception as e:  # playwright's TimeoutError
        return problems + [f"MathJax did not typeset the formulas ({e})"]
    page.evaluate("MathJax.startup.promise")
    for tex, shown, error in page.evaluate(_FORMULAS):
        if error or not shown:
            problems.append(
                f"formula {'with an error' if error else 'not shown'}: {tex}"
            )
    return problems


def check_search(page, url: str, problems: list[str]) -> int:
    """Searches ``SEARCH_TERM`` with the site's search box; returns the hits."""
    page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
    # The search worker loads the index first ("Initializing search").
    page.wait_for_function(
        "() => !document.querySelector('.md-search-result__meta')"
        ".textContent.includes('Initializing')",
        timeout=TIMEOUT_MS,
    )
    box = page.locator("input[data-md-component='search-query']")
    box.click(timeout=TIMEOUT_MS)
    box.press_sequentially(SEARCH_TERM, delay=50, timeout=TIMEOUT_MS)
    results = page.locator(".md-search-result__item")
    try:
        results.first.wait_for(state="attached", timeout=TIMEOUT_MS)
    except Exception as e:  # playwright's TimeoutError
        meta = page.locator(".md-search-result__meta").text_content()
        problems.append(f"search for {SEARCH_TERM!r}: no result ({meta!r}; {e})")
        return 0
    return results.count()


def _block_outside(route, base: str) -> None:
    if route.request.url.startswith(base):
        route.continue_()
    else:
        route.abort("blockedbyclient")


def check_site(
    site_dir: pathlib.Path,
    *,
    chromium: str = CHROMIUM,
    screenshot: pathlib.Path | None = None,
    search: bool = True,
) -> list[str]:
    """Every problem found on the pages of ``site_dir``; empty when all is well."""
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with serve(site_dir) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=WIDE)
            context.route("**/*", lambda route: _block_outside(route, base))
            for path in PAGES:
                page = context.new_page()
                check_page(page, base + path, problems)
                if path == "api/" and screenshot is not None:
                    # From the first docstring example on, where a reader looks.
                    examples = page.locator(".doc-section-title", has_text="Examples")
                    examples.first.evaluate(
                        "e => { e.scrollIntoView(); window.scrollBy(0, -80); }"
                    )
                    page.screenshot(path=str(screenshot))
                page.close()
            narrow = browser.new_context(viewport=NARROW)
            narrow.route("**/*", lambda route: _block_outside(route, base))
            for path in NARROW_PAGES:
                page = narrow.new_page()
                before = len(problems)
                check_page(page, base + path, problems)
                problems[before:] = [
                    f"{p} ({NARROW['width']} px)" for p in problems[before:]
                ]
                page.close()
            for viewport in (WIDE, NARROW):
                layout = browser.new_context(viewport=viewport)
                layout.route("**/*", lambda route: _block_outside(route, base))
                page = layout.new_page()
                before = len(problems)
                for path in site_pages(site_dir):
                    check_layout(page, base + path, problems)
                problems[before:] = [
                    f"{p} ({viewport['width']} px)" for p in problems[before:]
                ]
                layout.close()
            if search:
                hits = check_search(context.new_page(), base, problems)
                print(f"browser_check: search for {SEARCH_TERM!r}: {hits} result(s)")
        finally:
            browser.close()
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=pathlib.Path, help="a built site (else built)")
    parser.add_argument("--chromium", default=CHROMIUM, help="Chromium executable")
    parser.add_argument("--screenshot", type=pathlib.Path, help="PNG of the API page")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        site = args.site
        if site is None:
            site = pathlib.Path(tmp) / "site"
            build_site(site)
        problems = check_site(site, chromium=args.chromium, screenshot=args.screenshot)
    for problem in problems:
        print(f"browser_check: {problem}", file=sys.stderr)
    pages = ", ".join("/" + p for p in PAGES)
    print(f"browser_check: {pages}: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
