"""The code blocks of a docs page, and the page's examples as one script to copy.

A Python block either runs alone, pasted into a fresh file, or says on its first
line that it continues an example above (``# Continues the example above.``, or
naming the block it continues: ``# Continues the first example (rows).``).
A page with such blocks ends, on the site, with its examples in page order as one
script ("The whole page as one script"), made here when the site is built
(``on_page_markdown``, an mkdocs hook named in mkdocs.yml), so it cannot drift
from the blocks. ``tests/docs/test_docs.py`` runs every block and reads the pages
with ``blocks`` below.

The HTML comments (``<!-- test: ... -->``, invisible on the rendered page) that
tell the docs test how to run a block are described in tests/docs/test_docs.py.
"""

from __future__ import annotations

import re

_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
_MARK = re.compile(
    r"^\s*<!--\s*test:\s*(?P<kind>skip|requires|output|devices|alone)\b"
    r"\s*(?P<arg>.*?)\s*-->"
)
#: The first line of a block that continues the blocks above it on its page; it
#: may name the block it continues, and what it takes from it: "# Continues the
#: I/O-bound example above (fetch, ids)." (any first line "# Continues ... .").
CONTINUES = "# Continues the example above."
_CONTINUES = re.compile(r"# Continues [^\n]*\.[ \t]*(?:\n|$)")
#: The heading of the script appended to pages whose blocks continue.
HEADING = "## The whole page as one script"


def blocks(text: str) -> list[dict]:
    """The fenced code blocks of a markdown text, with their test marks.

    Each: ``lang``, ``line`` (of its opening fence, from 1), ``code`` (without
    the block's indent) and ``marks`` (``kind`` and ``arg`` of each
    ``<!-- test: ... -->`` comment on the lines just before it).
    """
    lines = text.splitlines()
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
        while k >= 0 and (mark := _MARK.match(lines[k])):
            marks.append(mark.groupdict())
            k -= 1
        code = "\n".join(line[indent:] for line in lines[start + 1 : j])
        found.append(
            {"lang": m["lang"], "line": start + 1, "code": code, "marks": marks}
        )
        i = j + 1
    return found


def is_python(block: dict) -> bool:
    """Whether ``block`` is a Python block (which the docs test runs)."""
    return block["lang"] in ("python", "py")


def continues(block: dict) -> bool:
    """Whether ``block`` says it continues the example above (its first line)."""
    return _CONTINUES.match(block["code"].lstrip("\n")) is not None


def in_page_script(block: dict) -> bool:
    """Whether ``block`` belongs to its page's script: not skipped, not alone."""
    own = {"skip", "devices", "alone"}
    return is_python(block) and not any(m["kind"] in own for m in block["marks"])


def whole_script(text: str) -> str | None:
    """The page's examples in order as one script; None if none continues."""
    found = [b for b in blocks(text) if in_page_script(b)]
    if not any(continues(b) for b in found):
        return None
    parts = []
    for b in found:
        code = b["code"].lstrip("\n")
        if continues(b):
            code = _CONTINUES.sub("", code, count=1).lstrip("\n")
        parts.append(code.rstrip("\n"))
    return "\n\n".join(parts) + "\n"


def on_page_markdown(markdown: str, **kwargs: object) -> str:
    """mkdocs hook: appends the whole-page script to pages whose blocks continue."""
    del kwargs
    script = whole_script(markdown)
    if script is None:
        return markdown
    return (
        f"{markdown.rstrip()}\n\n{HEADING}\n\n"
        "The examples of this page continue one another. Here they are in page "
        "order, as one file to copy and run:\n\n"
        f"```python\n{script}```\n"
    )
