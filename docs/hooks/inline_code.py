"""Inline code breaks between its words only, never inside one.

The theme lets the browser break inline code anywhere to fit the line: at 390 px
``--size`` became ``-`` / ``-size`` and a lone ``)`` started a line. This mkdocs
hook (named in mkdocs.yml) wraps each word (a run without spaces) of inline code
in a ``<span class="tok">``, which docs/stylesheets/code.css keeps on one line;
a word of 24 characters or more (``jax.experimental.transfer.start_transfer_server``),
12 in a table's cell, may still break after a ``.``, ``/``, ``,``, ``=`` or ``(`` (a
``<wbr>``) that leaves 3 characters or more on each side, so that it fits a phone.
Code blocks (``<pre>``) are left as they are.
tests/browser_check.py checks every page at 1280 and 390 px.
"""

from __future__ import annotations

import functools
import re

_TAG = re.compile(r"(<[^>]*>)")
_WORD = re.compile(r"\S+")
#: Where a long word may break: after one of these, unless a ")" follows.
_BREAK_AFTER = re.compile(r"([./,=(])(?=[^)])")
#: Words at least this long get break points: in prose, in a table's cell.
LONG, LONG_IN_TABLE = 24, 12


#: A break leaves at least this many characters on each side (no `(` / `2)`).
SIDE = 3


def _word(match: re.Match[str], long: int) -> str:
    word = match[0]
    if len(word) >= long:
        cuts = [
            m.end()
            for m in _BREAK_AFTER.finditer(word)
            if SIDE <= m.end() <= len(word) - SIDE
        ]
        parts = [word[i:j] for i, j in zip([0, *cuts], [*cuts, len(word)], strict=True)]
        word = "<wbr>".join(parts)
    return f'<span class="tok">{word}</span>'


def words_kept_whole(html: str) -> str:
    """``html`` with the words of its inline ``<code>`` in unbreakable spans."""
    parts = _TAG.split(html)
    depth = {"pre": 0, "code": 0, "td": 0, "th": 0}
    for i, part in enumerate(parts):
        if i % 2:  # a tag
            name = re.match(r"</?\s*(\w+)", part)
            if name and name[1].lower() in depth:
                depth[name[1].lower()] += -1 if part.startswith("</") else 1
        elif depth["code"] > 0 and depth["pre"] == 0 and part.strip():
            long = LONG_IN_TABLE if depth["td"] or depth["th"] else LONG
            parts[i] = _WORD.sub(functools.partial(_word, long=long), part)
    return "".join(parts)


def on_page_content(html: str, **kwargs: object) -> str:
    """mkdocs hook: keeps the words of each page's inline code whole."""
    del kwargs
    return words_kept_whole(html)
