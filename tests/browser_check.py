"""Opens the built docs site in headless Chromium, as a reader would.

Serves the site on 127.0.0.1 (a port the OS picks) and opens every page of it
(each ``index.html`` of the built site) in one tab of one browser: each page is
loaded at a desktop's width (1280 px), checked, narrowed to a phone's (390 px) and
checked again, every check of a width in one call into the page (about 20 s for
30 pages, where a fresh tab per page and width took 60 s). A page fails on a
console error (a script error, a resource that did not load), a broken image, a
formula that MathJax did not typeset, and
on its layout: the page scrolls sideways; a code line cut at the edge of its
block (wider than the block, so that its end is hidden); a table wider than the
text column (at 390 px a table of 5 columns or more may scroll sideways in its
own box, a narrower one must fit); a word of a table broken in two (a break at a
hyphen is no such break); inline code broken inside a word (``--size`` as ``-``
/ ``-size``; a long word may break after a ``.``, ``/``, ``,``, ``=`` or ``(``,
where docs/hooks/inline_code.py allows it) or running past the text column. A
search for "vmap" (typed into the search box of mkdocs-material) must find
something. Nothing is fetched from outside 127.0.0.1: a request elsewhere is
blocked and counts as a failure, so the site must work offline.

    .venv/bin/python tests/browser_check.py             # builds the site first (mkdocs)
    .venv/bin/python tests/browser_check.py --site site # a site built already
    .venv/bin/python tests/browser_check.py --heights   # and each page's height in px
    .venv/bin/python tests/browser_check.py --screenshot api.png

Needs ``playwright`` (the ``browser`` extra) and a Chromium executable: Debian's
and Ubuntu's ``chromium`` package (``apt-get install chromium``, which installs
from a local mirror or a package cache too: ``/usr/bin/chromium``), or any other
with ``--chromium PATH``. (``playwright install chromium`` downloads a browser
instead, which an offline machine cannot do.) Exit status 0 when every check
passes; otherwise each failure is printed.
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
import time
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
NARROW = {"width": 390, "height": 844}
WIDE = {"width": 1280, "height": 1600}
SEARCH_TERM = "vmap"
#: Bounds every wait on the browser, in milliseconds.
TIMEOUT_MS = 30_000
#: At a phone's width, a table of this many columns or more may scroll sideways
#: in its own box (benchmark tables); a narrower one must fit the text column.
WIDE_TABLE_COLUMNS = 5
#: The page whose docstring examples ``--screenshot`` shows.
SCREENSHOT_PAGE = "api-threadmap/"


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


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        # A page closed while it loads (the search index): a broken pipe.
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@contextlib.contextmanager
def serve(site_dir: pathlib.Path) -> Iterator[str]:
    """Serves ``site_dir`` on 127.0.0.1; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site_dir))
    server = _QuietServer(("127.0.0.1", 0), handler)
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


#: Every layout problem of the page (see the module's docstring), one line each;
#: its argument is the number of columns from which a table may scroll.
_LAYOUT = """(wideColumns) => {
    const cut = [];
    const root = document.documentElement;
    const sideways = root.scrollWidth - root.clientWidth;
    if (sideways > 1) {
        cut.push(`the page scrolls sideways by ${sideways} px`);
    }
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
    for (const table of document.querySelectorAll('table')) {
        // Wider than its box, or scrolled inside it (the theme's tables scroll).
        const box = table.closest('.md-typeset__scrollwrap') || table.parentElement;
        const over = Math.max(
            table.getBoundingClientRect().width - box.clientWidth,
            box.scrollWidth - box.clientWidth,
            table.scrollWidth - table.clientWidth,
        );
        const columns = table.rows.length ? table.rows[0].cells.length : 0;
        const allowed = window.innerWidth < 600 && columns >= wideColumns;
        if (over > 1 && !allowed) {
            const head = table.rows.length ? table.rows[0].textContent : '';
            const names = head.trim().replace(/\\s+/g, ' | ').slice(0, 60);
            cut.push(`table ${over.toFixed(0)} px wider than the text column `
                + `(${columns} columns): ${names}`);
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
    const article = document.querySelector('article') || document.body;
    const right = article.getBoundingClientRect().right;
    for (const code of article.querySelectorAll('code')) {
        if (code.closest('pre') || code.offsetParent === null) continue;
        // Its words (docs/hooks/inline_code.py), not the space that ends a line.
        const words = code.querySelectorAll('.tok');
        const boxes = Array.from(words.length ? words : [code])
            .flatMap((word) => Array.from(word.getClientRects()));
        const rects = Array.from(code.getClientRects());
        if (boxes.some((box) => box.right > right + 1) && !code.closest('table')) {
            const text = code.textContent.slice(0, 60);
            cut.push(`inline code runs past the text column: ${text}`);
        }
        if (new Set(rects.map((box) => Math.round(box.top))).size < 2) continue;
        // It wraps: each character's line, to find a break inside a word.
        const chars = [];
        const texts = document.createTreeWalker(code, NodeFilter.SHOW_TEXT);
        while (texts.nextNode()) {
            const node = texts.currentNode;
            for (let i = 0; i < node.textContent.length; i++) {
                const range = document.createRange();
                range.setStart(node, i);
                range.setEnd(node, i + 1);
                const box = Array.from(range.getClientRects()).find((b) => b.width > 0);
                chars.push([node.textContent[i], box ? Math.round(box.top) : null]);
            }
        }
        for (let i = 1; i < chars.length; i++) {
            const [prev, top0] = chars[i - 1];
            const [char, top1] = chars[i];
            if (top0 === null || top1 === null || top0 === top1) continue;
            if (/\\s/.test(prev) || /\\s/.test(char)) continue;
            if (/[./,=(]/.test(prev) && char !== ')') continue;
            const text = chars.map((c) => c[0]).join('');
            cut.push(`inline code broken inside a word: ${text.slice(0, 60)} `
                + `(${text.slice(Math.max(0, i - 12), i)} / ${text.slice(i, i + 12)})`);
            break;
        }
    }
    return cut;
}"""


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


#: Every check of the page as it is shown now, in one call (one round trip per page
#: and width). On a page with formulas it first waits, up to its second argument in
#: ms, for MathJax (loaded asynchronously) to typeset them all.
_CHECKS = f"""async ([wideColumns, timeoutMs]) => {{
    const count = document.querySelectorAll('.arithmatex').length;
    const typeset = () => Boolean(window.MathJax && MathJax.startup
        && MathJax.startup.promise
        && document.querySelectorAll('.arithmatex mjx-container').length === count);
    const deadline = Date.now() + timeoutMs;
    while (count && !typeset() && Date.now() < deadline) {{
        await new Promise((resolve) => setTimeout(resolve, 20));
    }}
    if (count && typeset()) await MathJax.startup.promise;
    return {{
        layout: ({_LAYOUT})(wideColumns),
        images: ({_BROKEN_IMAGES})(),
        tex: ({_LEFT_AS_TEX})(),
        untypeset: count > 0 && !typeset(),
        formulas: ({_FORMULAS})(),
        mathjax: document.querySelector('script[src*="tex-svg"]') !== null,
        height: document.documentElement.scrollHeight,
    }};
}}"""


def site_pages(site_dir: pathlib.Path) -> list[str]:
    """The paths of the site's pages (``""``, ``"api/"``, ...)."""
    found = (p.parent.relative_to(site_dir) for p in site_dir.rglob("index.html"))
    return sorted("" if p == pathlib.Path() else f"{p.as_posix()}/" for p in found)


def check_shown(page) -> tuple[list[str], int]:
    """The problems of the page open in ``page``, at its width now; its height in px.

    Its broken images, formulas (each typeset, without an error) and layout.
    """
    found = page.evaluate(_CHECKS, [WIDE_TABLE_COLUMNS, TIMEOUT_MS])
    problems = [f"broken image {src}" for src in found["images"]]
    problems += [f"maths left as TeX: {t!r}" for t in found["tex"]]
    if found["untypeset"]:
        problems.append(f"MathJax did not typeset the formulas in {TIMEOUT_MS} ms")
    for tex, shown, error in found["formulas"]:
        if error or not shown:
            problems.append(
                f"formula {'with an error' if error else 'not shown'}: {tex}"
            )
    if found["mathjax"] and not found["formulas"]:
        problems.append("loads MathJax (2 MB) but has no formula")
    return problems + found["layout"], found["height"]


class _Tab:
    """One browser tab that opens the site's pages in turn.

    Keeps the console errors, uncaught exceptions and failed requests of the page
    open now (``errors``, emptied by ``open``).
    """

    def __init__(self, context) -> None:
        self.page = context.new_page()
        self.errors: list[str] = []
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))
        self.page.on("requestfailed", self._failed)
        self.page.on("response", self._response)

    def _console(self, message) -> None:
        # Chromium logs a resource's error status late, at times once the next page
        # is open: _response names it instead, in order, before the page's load.
        if message.type == "error" and not message.text.startswith(
            "Failed to load resource"
        ):
            self.errors.append(message.text)

    def _response(self, response) -> None:
        if response.status >= 400:
            self.errors.append(f"HTTP {response.status}: {response.url}")

    def _failed(self, request) -> None:
        # The previous page's requests still loading (its search index) are
        # aborted when the tab opens the next one: no failure of either page.
        if request.failure != "net::ERR_ABORTED":
            self.errors.append(f"request failed: {request.url} ({request.failure})")

    def open(self, url: str, viewport: dict[str, int]) -> list[str]:
        """Opens ``url`` at the width of ``viewport``; a problem if it did not load."""
        self.page.set_viewport_size(viewport)
        self.errors.clear()
        response = self.page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
        if response is None or not response.ok:
            return [f"HTTP {response.status if response else 'none'}"]
        return []


def check_search(page, problems: list[str]) -> int:
    """Searches ``SEARCH_TERM`` with the search box of the page open in ``page``.

    Returns the hits.
    """
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
    heights: dict[str, dict[int, int]] | None = None,
) -> list[str]:
    """Every problem found on the pages of ``site_dir``; empty when all is well.

    One browser, one tab: each page is loaded once, at a desktop's width, checked,
    narrowed to a phone's width and checked again (one call into the page per page
    and width; a load costs more than every check together). ``heights``, if given,
    gets each page's height in px per width (``{"api/": {1280: 1600, 390: 844}}``).
    """
    from playwright.sync_api import sync_playwright

    problems: list[str] = []
    with serve(site_dir) as base, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport=WIDE)
            context.route("**/*", lambda route: _block_outside(route, base))
            tab = _Tab(context)
            for path in site_pages(site_dir):
                url = base + path
                problems += [f"{url}: {p}" for p in tab.open(url, WIDE)]
                for viewport in (WIDE, NARROW):
                    tab.page.set_viewport_size(viewport)
                    found, height = check_shown(tab.page)
                    width = viewport["width"]
                    problems += [f"{url}: {p} ({width} px)" for p in found]
                    if heights is not None:
                        heights.setdefault(path, {})[width] = height
                    if path == SCREENSHOT_PAGE and viewport is WIDE and screenshot:
                        take_screenshot(tab.page, screenshot)
                problems += [
                    f"{url}: console error: {e} (at {WIDE['width']} px, then "
                    f"{NARROW['width']} px)"
                    for e in tab.errors
                ]
            if search:
                problems += [f"{base}: {p}" for p in tab.open(base, WIDE)]
                hits = check_search(tab.page, problems)
                print(f"browser_check: search for {SEARCH_TERM!r}: {hits} result(s)")
            context.close()
        finally:
            browser.close()
    return problems


def take_screenshot(page, path: pathlib.Path) -> None:
    """A PNG of ``page`` from its first docstring example on, where a reader looks."""
    examples = page.locator(".doc-section-title", has_text="Examples")
    examples.first.evaluate("e => { e.scrollIntoView(); window.scrollBy(0, -80); }")
    page.screenshot(path=str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site", type=pathlib.Path, help="a built site (else built)")
    parser.add_argument("--chromium", default=CHROMIUM, help="Chromium executable")
    parser.add_argument(
        "--screenshot", type=pathlib.Path, help=f"PNG of /{SCREENSHOT_PAGE}"
    )
    parser.add_argument(
        "--heights", action="store_true", help="print each page's height in px"
    )
    args = parser.parse_args(argv)
    heights: dict[str, dict[int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        site = args.site
        if site is None:
            site = pathlib.Path(tmp) / "site"
            build_site(site)
        started = time.monotonic()
        problems = check_site(
            site, chromium=args.chromium, screenshot=args.screenshot, heights=heights
        )
        seconds = time.monotonic() - started
    if args.heights:
        print(f"{'page':28} {WIDE['width']:>7} {NARROW['width']:>7}  (px tall)")
        for path, height in heights.items():
            print(
                f"{'/' + path:28} {height[WIDE['width']]:7} {height[NARROW['width']]:7}"
            )
    for problem in problems:
        print(f"browser_check: {problem}", file=sys.stderr)
    print(
        f"browser_check: {len(heights)} pages at {WIDE['width']} and "
        f"{NARROW['width']} px in {seconds:.1f} s: {len(problems)} problem(s)"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
