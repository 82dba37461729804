"""Turns saved benchmark results into the docs' tables and plots.

Usage::

    pytest benchmarks/ --benchmark-only --benchmark-json=results.json
    python benchmarks/report.py results.json                 # tables on stdout
    python benchmarks/report.py results.json --write-docs    # docs/ and README

``--write-docs`` replaces the marked regions of ``docs/performance.md``,
``README.md`` and ``docs/index.md`` with fresh tables and writes the plots to
``docs/img/`` (needs matplotlib, the ``plot`` extra).

Every comparison uses the median wall time of a batch divided by the elements
it ran (``--stat min`` for the best round instead). ``ideal`` is the serial
kernel time (the bare loop, per element) divided by the threads the case uses.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import re
from collections.abc import Iterable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent

METHOD_TITLES = {
    "threadmap": "`threadmap`",
    "recipe": "`pure_callback` + thread pool",
    "sequential": "`pure_callback` sequential",
    "bare_loop": "bare loop, no JAX",
    "ideal": "ideal: serial time / threads",
}
METHOD_ORDER = ["threadmap", "recipe", "sequential", "bare_loop", "ideal"]
#: Groups compared against a floor: group -> (floor method, {method: title}).
FLOOR_GROUPS = {
    "vectorized-outer": (
        "numpy",
        {
            "vectorized": "`threadmap(..., vectorized=True)`",
            "per_element": "`threadmap`, one kernel call per element",
            "numpy": "NumPy on broadcast arrays (floor)",
        },
    ),
    "vectorized-sort_rows": (
        "hand_threads",
        {
            "vectorized": "`threadmap(..., vectorized=True)`",
            "hand_threads": "thread pool by hand, a block of rows per core (floor)",
            "callback_only": "`pure_callback` returning a preallocated result "
            "(no sort: the host callback's own cost)",
        },
    ),
}
CASE_ORDER = ["trivial", "sleep", "sort"]
#: An entry whose run shared the machine with more than this many busy cores of
#: other processes is flagged in the tables.
NOISY_CORES = 0.25

# Targets of issue 3 (2-core machine): (ratio name, "<=" or ">=", bound).
TARGETS = {
    "trivial": [("threadmap / bare loop", "<=", 1.3)],
    "sleep": [("threadmap / ideal", "<=", 1.05), ("sequential / threadmap", ">=", 30)],
    "sort": [("threadmap / ideal", "<=", 1.2)],
    "scaling-size": [("max / min threadmap per element", "<=", 1.3)],
    "scaling-depth": [("max / min threadmap per element", "<=", 1.3)],
    "memory": [("threadmap added / budget", "<=", 1.1)],
    "vectorized-outer": [
        ("vectorized / numpy", "<=", 2.5),
        ("per_element / vectorized", ">=", 50),
    ],
    "vectorized-sort_rows": [("vectorized / hand_threads", "<=", 1.2)],
    "vectorized-memory": [("vectorized added / budget", "<=", 1.1)],
}


# --- reading ------------------------------------------------------------------------


def load(paths: Iterable[str | pathlib.Path]) -> list[dict[str, Any]]:
    """The ``benchmarks`` entries of pytest-benchmark JSON files, later files last;
    each entry carries the commit and date of its run (``_commit``, ``_date``)."""
    entries = []
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        commit = (data.get("commit_info") or {}).get("id") or ""
        date = str(data.get("datetime") or "")[:10]
        for entry in data["benchmarks"]:
            entries.append({**entry, "_commit": commit[:7], "_date": date})
    return entries


def _latest(entries, group: str) -> dict[str, dict[str, Any]]:
    """Entries of ``group`` keyed by a name unique within it (last one wins)."""
    out = {}
    for e in entries:
        if e.get("group") == group:
            info = e["extra_info"]
            key = info["method"]
            if group == "scaling-size":
                key = (info["method"], info["elements"])
            elif group == "scaling-depth":
                key = (info["method"], info["depth"])
            out[key] = e
    return out


def per_element(entry: dict[str, Any], stat: str = "median") -> float:
    """Seconds per element of one entry."""
    return entry["stats"][stat] / entry["extra_info"]["elements"]


def _other(entry) -> float | None:
    """Average CPUs that other processes kept busy while the entry ran."""
    return entry["extra_info"].get("other_cores")


def _noise_note(cores: float | None) -> str:
    if cores is None or cores <= NOISY_CORES:
        return ""
    return f" (other load {cores:.1f} cores)"


def _check(name: str, value: float, op: str, bound: float) -> dict[str, Any]:
    ok = value <= bound if op == "<=" else value >= bound
    return {"name": name, "value": value, "target": f"{op} {bound:g}", "ok": ok}


# --- analysis -----------------------------------------------------------------------


def analyse(entries: list[dict[str, Any]], stat: str = "median") -> dict[str, Any]:
    """Per-element times and ratios of every group present in ``entries``."""
    result: dict[str, Any] = {"stat": stat, "compare": {}}
    for case in CASE_ORDER:
        got = _latest(entries, f"compare-{case}")
        if got:
            result["compare"][case] = _analyse_compare(case, got, stat)
    sizes = _latest(entries, "scaling-size")
    if sizes:
        result["size"] = _analyse_scaling(sizes, stat, "elements")
    depths = _latest(entries, "scaling-depth")
    if depths:
        result["depth"] = _analyse_scaling(depths, stat, "depth")
    memory = _latest(entries, "memory")
    if memory:
        result["memory"] = _analyse_memory(memory)
    result["floors"] = {}
    for group in FLOOR_GROUPS:
        got = _latest(entries, group)
        if got:
            result["floors"][group] = _analyse_floor(group, got, stat)
    memory = _latest(entries, "vectorized-memory")
    if memory:
        result["vector_memory"] = _analyse_memory(memory, "vectorized-memory")
    # The revisions the numbers come from (the docs name them beside the numbers).
    result["commits"] = sorted(
        {(e["_date"], e["_commit"]) for e in entries if e.get("_commit")}
    )
    signatures = _analyse_signatures(entries)
    if signatures:
        result["signatures"] = signatures
    small = _analyse_small_maps(entries)
    if small:
        result["small_maps"] = small
    operators = _analyse_operators(entries)
    if operators:
        result["operators"] = operators
    return result


def _analyse_small_maps(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """Small maps against one host callback looping over the same elements
    (best per element in extra_info, with each size's target ratio)."""
    rows = {}
    for e in entries:
        if (e.get("group") or "").startswith("small-map-"):
            info = e["extra_info"]
            rows[info["elements"]] = {
                "title": info["title"],
                "threadmap": info["threadmap"],
                "loop": info["loop"],
                "ratio": info["threadmap"] / info["loop"],
                "target": info["target"],
                "other": _other(e),
            }
    checks = [
        _check(f"threadmap / loop, {n} elements", r["ratio"], "<=", r["target"])
        for n, r in sorted(rows.items())
    ]
    return {"rows": dict(sorted(rows.items())), "checks": checks} if rows else {}


def _analyse_operators(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """An AsyncArray's operators (landed, pending) against a jax.Array's, per call
    (test_bench_operators.py: the times and ratios in extra_info)."""
    rows = {
        e["extra_info"]["case"]: {**e["extra_info"], "other": _other(e)}
        for e in entries
        if e.get("group") == "operators"
    }
    if not rows:
        return {}
    checks = []
    for ratio in ("landed / jax.Array", "pending / jax.Array"):
        worst = max(rows, key=lambda k: rows[k][ratio])
        checks.append(_check(f"worst {ratio} (`{worst}`)", rows[worst][ratio], "<=", 2))
    return {"rows": rows, "checks": checks}


def _analyse_signatures(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """threadmap against its floor per kernel signature (medians in extra_info)."""
    rows = {}
    for e in entries:
        group = e.get("group") or ""
        if group.startswith("signature-"):
            info = e["extra_info"]
            rows[info["case"]] = {
                "title": info["title"],
                "threadmap": info["threadmap"],
                "floor": info["floor"],
                "ratio": info["threadmap"] / info["floor"],
                "other": _other(e),
            }
    if not rows:
        return {}
    worst = max(rows, key=lambda k: rows[k]["ratio"])
    checks = [
        _check(f"worst threadmap / floor ({rows[worst]['title']})", r, "<=", 1.2)
        for r in [rows[worst]["ratio"]]
    ]
    return {"rows": rows, "checks": checks}


def _analyse_floor(group: str, got: dict[str, dict], stat: str) -> dict[str, Any]:
    """Per-element times of each method of ``group``, and ratios to its floor."""
    floor, _ = FLOOR_GROUPS[group]
    rows = {}
    for method, e in got.items():
        info = e["extra_info"]
        # Methods timed round by round in one test: their medians per element.
        timed = info.get("per_element") or {method: per_element(e, stat)}
        for m, seconds in timed.items():
            rows[m] = {
                "per_element": seconds,
                "elements": info["elements"],
                "batch_elements": info["batch_elements"],
                "other": _other(e),
            }
    ratios = {}
    if floor in rows:
        for method, r in rows.items():
            if method != floor:
                ratios[f"{method} / {floor}"] = (
                    r["per_element"] / rows[floor]["per_element"]
                )
    if "callback_only" in rows and "vectorized" in rows and floor in rows:
        # The floor plus the host callback's own cost: what any host callback
        # doing the floor's work pays at least.
        both = rows[floor]["per_element"] + rows["callback_only"]["per_element"]
        ratios[f"vectorized / ({floor} + callback_only)"] = (
            rows["vectorized"]["per_element"] / both
        )
    if "per_element" in rows and "vectorized" in rows:
        ratios["per_element / vectorized"] = (
            rows["per_element"]["per_element"] / rows["vectorized"]["per_element"]
        )
    checks = [
        _check(name, ratios[name], op, bound)
        for name, op, bound in TARGETS.get(group, [])
        if name in ratios
    ]
    title = next(iter(got.values()))["extra_info"].get("title", group)
    return {"title": title, "rows": rows, "ratios": ratios, "checks": checks}


def _analyse_compare(case: str, got: dict[str, dict], stat: str) -> dict[str, Any]:
    rows = {}
    for method, e in got.items():
        info = e["extra_info"]
        rows[method] = {
            "per_element": per_element(e, stat),
            "elements": info["elements"],
            "batch_elements": info["batch_elements"],
            "other": _other(e),
        }
    any_info = next(iter(got.values()))["extra_info"]
    workers = any_info.get("workers")
    if case != "trivial" and "bare_loop" in rows and workers:
        rows["ideal"] = {
            "per_element": rows["bare_loop"]["per_element"] / workers,
            "elements": None,
            "batch_elements": rows["bare_loop"]["batch_elements"],
            "other": rows["bare_loop"]["other"],
        }
    ratios = {}
    tm = rows.get("threadmap", {}).get("per_element")
    other = rows.get("threadmap", {}).get("other")
    cpus = any_info.get("cpus")
    busy = other is not None and other > NOISY_CORES
    if tm and "ideal" in rows and any_info.get("cpu_bound") and busy and cpus:
        # A CPU-bound kernel can only use the CPUs other processes leave free.
        free = max(1.0, cpus - other)
        if free < workers:
            serial = rows["bare_loop"]["per_element"]
            ratios["threadmap / ideal on the free CPUs"] = tm / (serial / free)
    if tm:
        for method in ("bare_loop", "ideal"):
            if method in rows:
                name = f"threadmap / {method.replace('_', ' ')}"
                ratios[name] = tm / rows[method]["per_element"]
        for method in ("sequential", "recipe"):
            if method in rows:
                ratios[f"{method} / threadmap"] = rows[method]["per_element"] / tm
    checks = [
        _check(name, ratios[name], op, bound)
        for name, op, bound in TARGETS.get(case, [])
        if name in ratios
    ]
    label = {
        "trivial": "trivial `x + 1`",
        "sleep": f"sleep 1 ms, {workers} threads",
        "sort": f"sort 100k floats, {workers} threads",
    }.get(case, case)
    return {
        "title": any_info.get("title", case),
        "label": label,
        "workers": workers,
        "rows": rows,
        "ratios": ratios,
        "checks": checks,
    }


def _analyse_scaling(got: dict, stat: str, key: str) -> dict[str, Any]:
    table: dict[Any, dict[str, float]] = {}
    shapes = {}
    other: dict[Any, float] = {}
    for (method, k), e in got.items():
        table.setdefault(k, {})[method] = per_element(e, stat)
        shapes[k] = e["extra_info"].get("batch_shape")
        other[k] = max(other.get(k, 0.0), _other(e) or 0.0)
    keys = sorted(table)
    tm = [table[k]["threadmap"] for k in keys if "threadmap" in table[k]]
    checks = []
    if tm:
        flat = max(tm) / min(tm)
        checks.append(_check("max / min threadmap per element", flat, "<=", 1.3))
    return {
        "key": key,
        "keys": keys,
        "table": table,
        "shapes": shapes,
        "other": other,
        "checks": checks,
    }


def _analyse_memory(got: dict, group: str = "memory") -> dict[str, Any]:
    rows = {}
    for method, e in got.items():
        info = e["extra_info"]
        rows[method] = {
            k: info[k]
            for k in (
                "input_bytes",
                "output_bytes",
                "chunk_bytes",
                "added_bytes",
                "budget_bytes",
            )
            if k in info
        }
        rows[method]["ratio"] = info["added_bytes"] / info["budget_bytes"]
        rows[method]["elements"] = info["elements"]
    checks = [
        _check(name, rows[name.split()[0]]["ratio"], op, bound)
        for name, op, bound in TARGETS[group]
        if name.split()[0] in rows
    ]
    return {"rows": rows, "checks": checks}


# --- markdown -----------------------------------------------------------------------


def fmt_time(seconds: float) -> str:
    """``2.31 µs``, ``1.32 ms``, ``4.7 s``: three significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            value = seconds / scale
            digits = max(0, 2 - int(math.floor(math.log10(value)))) if value else 0
            return f"{value:.{digits}f} {unit}"
    raise AssertionError  # pragma: no cover


def fmt_ratio(x: float) -> str:
    return f"{x:.2f}x" if x < 10 else f"{x:.0f}x"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _checks(checks, ratios=None) -> str:
    lines = [
        f"- {name} = {fmt_ratio(value)} (for information)"
        for name, value in (ratios or {}).items()
        if name not in {c["name"] for c in checks}
    ]
    return "\n".join(
        lines
        + [
            f"- {c['name']} = **{fmt_ratio(c['value'])}** (target {c['target']}: "
            f"{'met' if c['ok'] else 'NOT met'})"
            for c in checks
        ]
    )


def markdown(a: dict[str, Any]) -> str:
    """Every table of the analysis, with the target checks under each."""
    parts: list[str] = []
    for case, c in a["compare"].items():
        parts += _compare_markdown(case, c)
    for name, title in (("size", "Batch size"), ("depth", "Nesting depth")):
        if a.get(name):
            parts += _scaling_markdown(a[name], title)
    if a.get("memory"):
        parts += _memory_markdown(a["memory"])
    for group, f in a.get("floors", {}).items():
        parts += _floor_markdown(group, f)
    if a.get("vector_memory"):
        parts += _vector_memory_markdown(a["vector_memory"])
    if a.get("signatures"):
        parts += _signatures_markdown(a["signatures"])
    if a.get("small_maps"):
        parts += _small_maps_markdown(a["small_maps"])
    if a.get("operators"):
        parts += _operators_markdown(a["operators"])
    return "\n".join(parts).rstrip() + "\n"


def _small_maps_markdown(small: dict[str, Any]) -> list[str]:
    rows = [
        [
            str(n),
            fmt_time(r["threadmap"]),
            fmt_time(r["loop"]),
            fmt_ratio(r["ratio"]) + _noise_note(r["other"]),
        ]
        for n, r in small["rows"].items()
    ]
    header = ["elements", "`threadmap`", "one `pure_callback`, a loop", "ratio"]
    title = next(iter(small["rows"].values()))["title"]
    return [
        f"#### Small maps: {title}, per element\n",
        _table(header, rows),
        "",
        _checks(small["checks"]),
        "",
    ]


def _signatures_markdown(sig: dict[str, Any]) -> list[str]:
    rows = [
        [
            r["title"],
            fmt_time(r["threadmap"]),
            fmt_time(r["floor"]),
            fmt_ratio(r["ratio"]) + _noise_note(r["other"]),
        ]
        for r in sig["rows"].values()
    ]
    header = ["signature, 4096 elements", "`threadmap`", "floor (bare loop)", "ratio"]
    return [
        "#### Every kernel signature against its floor, trivial kernel\n",
        _table(header, rows),
        "",
        _checks(sig["checks"]),
        "",
    ]


def _operators_markdown(ops: dict[str, Any]) -> list[str]:
    rows = [
        [
            f"`{case}`",
            fmt_time(r["jax.Array"]),
            f"{fmt_time(r['landed'])} ({fmt_ratio(r['landed / jax.Array'])})",
            f"{fmt_time(r['pending'])} ({fmt_ratio(r['pending / jax.Array'])})"
            + _noise_note(r["other"]),
        ]
        for case, r in ops["rows"].items()
    ]
    header = ["per call, (256, 64) float32", "`jax.Array`", "landed", "pending"]
    return [
        "#### `AsyncArray` operators against `jax.Array`'s\n",
        _table(header, rows),
        "",
        _checks(ops["checks"]),
        "",
    ]


def _floor_markdown(group: str, f: dict[str, Any]) -> list[str]:
    floor, titles = FLOOR_GROUPS[group]
    floor_time = f["rows"].get(floor, {}).get("per_element")
    rows = []
    for method, title in titles.items():
        r = f["rows"].get(method)
        if r is None:
            continue
        timed = str(r["elements"])
        if r["elements"] < r["batch_elements"]:
            timed += " (extrapolated)"
        vs = fmt_ratio(r["per_element"] / floor_time) if floor_time else "-"
        rows.append(
            [
                title,
                fmt_time(r["per_element"]),
                fmt_time(r["per_element"] * r["batch_elements"]),
                vs,
                timed + _noise_note(r["other"]),
            ]
        )
    header = ["method", "per element", "whole batch", "vs floor", "elements timed"]
    return [
        f"#### {f['title']}\n",
        _table(header, rows),
        "",
        _checks(f["checks"], f["ratios"]),
        "",
    ]


def _vector_memory_markdown(m: dict[str, Any]) -> list[str]:
    mb = 2**20
    r = m["rows"]["vectorized"]
    row = [
        "`threadmap(..., vectorized=True)`",
        f"{r['output_bytes'] / mb:.0f} MB",
        f"{r['chunk_bytes'] / mb:.0f} MB",
        f"{r['added_bytes'] / mb:.0f} MB",
        f"{r['budget_bytes'] / mb:.0f} MB",
        fmt_ratio(r["ratio"]),
    ]
    header = [
        "method",
        "outputs",
        "a chunk per worker",
        "peak added",
        "budget",
        "added / budget",
    ]
    return [
        "#### Peak memory: `x + y + z` over 256 x 256 x 256, vectorized\n",
        _table(header, [row]),
        "",
        _checks(m["checks"]),
        "",
    ]


def _compare_markdown(case: str, c: dict[str, Any]) -> list[str]:
    rows = []
    tm = c["rows"].get("threadmap", {}).get("per_element")
    for method in METHOD_ORDER:
        r = c["rows"].get(method)
        if r is None:
            continue
        batch = r["per_element"] * r["batch_elements"]
        timed = "-" if r["elements"] is None else str(r["elements"])
        if r["elements"] is not None and r["elements"] < r["batch_elements"]:
            timed += " (extrapolated)"
        vs = fmt_ratio(r["per_element"] / tm) if tm else "-"
        rows.append(
            [
                METHOD_TITLES[method],
                fmt_time(r["per_element"]),
                fmt_time(batch),
                vs,
                timed + _noise_note(r["other"]),
            ]
        )
    header = [
        "method",
        "per element",
        "4096 elements",
        "vs threadmap",
        "elements timed",
    ]
    return [
        f"#### {c['title']} ({case}), 16 x 16 x 16 nested vmap\n",
        _table(header, rows),
        "",
        _checks(c["checks"], c["ratios"]),
        "",
    ]


def _scaling_markdown(s: dict[str, Any], title: str) -> list[str]:
    methods = [m for m in METHOD_ORDER if any(m in t for t in s["table"].values())]
    header = [s["key"], "batch shape"] + [METHOD_TITLES[m] for m in methods]
    header.append("threadmap / bare loop")
    rows = []
    for k in s["keys"]:
        t = s["table"][k]
        row = [str(k), "x".join(map(str, s["shapes"][k] or []))]
        row += [fmt_time(t[m]) if m in t else "-" for m in methods]
        ratio = "-"
        if "threadmap" in t and "bare_loop" in t:
            ratio = fmt_ratio(t["threadmap"] / t["bare_loop"])
        row.append(ratio + _noise_note(s["other"].get(k)))
        rows.append(row)
    return [
        f"#### {title}: per-element cost, trivial kernel\n",
        _table(header, rows),
        "",
        _checks(s["checks"]),
        "",
    ]


def _memory_markdown(m: dict[str, Any]) -> list[str]:
    mb = 2**20
    rows = []
    for method in METHOD_ORDER:
        r = m["rows"].get(method)
        if r is None:
            continue
        rows.append(
            [
                METHOD_TITLES[method],
                f"{r['output_bytes'] / mb:.0f} MB",
                f"{r['added_bytes'] / mb:.0f} MB",
                f"{r['budget_bytes'] / mb:.0f} MB",
                fmt_ratio(r["ratio"]),
            ]
        )
    header = ["method", "outputs", "peak added", "budget", "added / budget"]
    return [
        "#### Peak memory: 4096 elements of 64 KB results\n",
        _table(header, rows),
        "",
        _checks(m["checks"]),
        "",
    ]


def headline(a: dict[str, Any]) -> str:
    """The README's tables, narrow enough for a phone: per-element time of
    ``threadmap`` and how much slower each baseline is, per case; then
    ``threadmap`` against the floor of each case."""
    header = ["kernel", "`threadmap`", "sequential: slower", "thread pool: slower"]
    rows, floors = [], []
    for c in a["compare"].values():
        r = c["rows"]
        if "threadmap" not in r:
            continue
        tm = r["threadmap"]["per_element"]

        def slower(method, r=r, tm=tm):
            if method not in r:
                return "-"
            return fmt_ratio(r[method]["per_element"] / tm)

        rows.append([c["label"], fmt_time(tm), slower("sequential"), slower("recipe")])
        floor = "ideal" if "ideal" in r else "bare_loop"
        if floor in r:
            x = r[floor]["per_element"]
            name = "ideal" if floor == "ideal" else "bare loop"
            floors.append(
                [c["label"], fmt_time(tm), f"{name} {fmt_time(x)}", fmt_ratio(tm / x)]
            )
    note = (
        "\n4096 elements in 3 nested vmaps: the per-element wall time (median) of "
        '`threadmap`, and how much slower `pure_callback(vmap_method="sequential")` '
        "is, and `pure_callback` with a thread pool per call (the best recipe "
        "without this package).\n"
    )
    text = _table(header, rows) + "\n" + note + _measured_at(a)
    floors += _headline_floors(a)
    if floors:
        text += "\n" + _table(["against", "`threadmap`", "floor", "ratio"], floors)
        text += (
            "\n\nThe floor: a bare Python loop over NumPy views, or the serial kernel "
            "time divided by the threads (ideal). Signatures: the worst of 1-4 "
            "operands, keyword arguments, pytree arguments and results, several "
            "outputs, unmergeable layouts and a 32-thread executor, each against a "
            "bare loop calling the same kernel (worst: "
            + _worst_signature(a)
            + "). Vectorized: `x + y + z` on a 128^3 outer product against NumPy on "
            "broadcast arrays, and `np.sort` of 2048 rows against a thread pool by "
            "hand (a block of rows per core).\n"
        )
    return text


def _measured_at(a: dict[str, Any]) -> str:
    """Which revision of the package the numbers were measured on, and when."""
    commits = a.get("commits") or []
    if not commits:
        return ""
    said = ", ".join(f"`{commit}` ({date})" for date, commit in commits)
    return f"Measured at commit {said}.\n"


def _worst_signature(a: dict[str, Any]) -> str:
    sig = a.get("signatures", {}).get("rows")
    if not sig:
        return "-"
    return str(max(sig.values(), key=lambda r: r["ratio"])["title"])


def _headline_floors(a: dict[str, Any]) -> list[list[str]]:
    """README rows: the signature matrix's worst case and the vectorized cases."""
    rows = []
    sig = a.get("signatures", {}).get("rows")
    if sig:
        worst = max(sig.values(), key=lambda r: r["ratio"])
        rows.append(
            [
                "worst kernel signature",
                fmt_time(worst["threadmap"]),
                f"bare loop {fmt_time(worst['floor'])}",
                fmt_ratio(worst["ratio"]),
            ]
        )
    labels = {
        "vectorized-outer": "vectorized `x + y + z`",
        "vectorized-sort_rows": "vectorized `np.sort` of rows",
    }
    for group, f in a.get("floors", {}).items():
        floor, titles = FLOOR_GROUPS[group]
        r = f["rows"]
        if "vectorized" not in r or floor not in r:
            continue
        tm, fl = r["vectorized"]["per_element"], r[floor]["per_element"]
        name = {"numpy": "NumPy", "hand_threads": "hand pool"}.get(floor, floor)
        rows.append(
            [labels[group], fmt_time(tm), f"{name} {fmt_time(fl)}", fmt_ratio(tm / fl)]
        )
    return rows


# --- plots --------------------------------------------------------------------------


def plots(a: dict[str, Any], outdir: pathlib.Path) -> list[pathlib.Path]:
    """Writes the comparison and scaling plots as PNG files; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    colors = {
        "threadmap": "tab:blue",
        "recipe": "tab:orange",
        "sequential": "tab:red",
        "bare_loop": "tab:gray",
        "ideal": "tab:green",
    }
    labels = {
        "threadmap": "threadmap",
        "recipe": "pure_callback + thread pool",
        "sequential": "pure_callback sequential",
        "bare_loop": "bare loop (serial)",
        "ideal": "ideal (serial / threads)",
    }
    if a["compare"]:
        cases = list(a["compare"])
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.16
        for j, method in enumerate(METHOD_ORDER):
            xs, ys = [], []
            for i, case in enumerate(cases):
                r = a["compare"][case]["rows"].get(method)
                if r is not None:
                    xs.append(i + (j - 2) * width)
                    ys.append(r["per_element"] * 1e6)
            ax.bar(xs, ys, width, label=labels[method], color=colors[method])
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(
            ["trivial x + 1" if c == "trivial" else c for c in cases] if cases else []
        )
        ax.set_yscale("log")
        ax.set_ylabel("µs per element (log)")
        ax.set_title("16 x 16 x 16 nested vmap: time per element")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, outdir / "compare.png"))
    for name, xlabel in (("size", "elements"), ("depth", "nested vmap levels")):
        s = a.get(name)
        if not s:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        shown: list[float] = []
        for method in METHOD_ORDER:
            pts = [
                (k, s["table"][k][method]) for k in s["keys"] if method in s["table"][k]
            ]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ys = [y * 1e6 for y in ys]
                shown += ys
                ax.plot(xs, ys, "o-", label=labels[method], color=colors[method])
        ax.set_xscale("log", base=2)
        if name == "depth":  # 1, 2, 4, 8 levels, not 2^0 ... 2^3
            ax.set_xticks(list(s["keys"]), [str(k) for k in s["keys"]])
        if shown and max(shown) < 10 * min(shown):
            # Within a decade a log axis labels its minor ticks as 9.2x10^-1:
            # a linear one, from 0, with plain numbers reads at once.
            ax.set_ylim(0, max(shown) * 1.15)
            ax.ticklabel_format(axis="y", style="plain", useOffset=False)
            ax.set_ylabel("µs per element")
        else:
            ax.set_yscale("log")
            ax.set_ylabel("µs per element (log)")
        ax.set_xlabel(xlabel)
        ax.set_title(f"Trivial kernel: per-element cost vs {xlabel}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        written.append(_save(fig, outdir / f"scaling_{name}.png"))
    return written


def _save(fig, path: pathlib.Path) -> pathlib.Path:
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


# --- writing the docs ---------------------------------------------------------------


def replace_region(text: str, name: str, content: str) -> str:
    """Replaces what lies between ``<!-- benchmarks:NAME -->`` and its end marker."""
    start, end = f"<!-- benchmarks:{name} -->", f"<!-- /benchmarks:{name} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise ValueError(f"No region {start} ... {end} to replace.")
    return pattern.sub(lambda _: f"{start}\n{content.strip()}\n{end}", text)


#: How the ratios' method names read on the docs' pages.
READER_NAMES = {
    "hand_threads": "thread pool by hand",
    "callback_only": "the host callback's own cost",
    "per_element": "one call per element",
    "numpy": "NumPy",
}


def for_readers(text: str) -> str:
    """The tables' text as the docs' pages show it: each ratio under its plain
    name, without the benchmark's targets (which the run's end prints)."""
    text = re.sub(r" \(target [^)]*: (?:met|NOT met)\)", "", text)
    text = text.replace(" (for information)", "")
    for name, words in READER_NAMES.items():
        text = re.sub(rf"\b{name}\b(?=[^|\n]*= )", words, text)
    return text


def write_docs(a: dict[str, Any], root: pathlib.Path = ROOT) -> None:
    perf = root / "docs" / "performance.md"
    tables = for_readers(markdown(a))
    perf.write_text(replace_region(perf.read_text(), "tables", tables))
    # The headline numbers, on the README and on the docs' home page alike.
    for page in (root / "README.md", root / "docs" / "index.md"):
        page.write_text(replace_region(page.read_text(), "headline", headline(a)))
    plots(a, root / "docs" / "img")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", nargs="+", help="pytest-benchmark JSON file(s)")
    parser.add_argument("--stat", default="median", choices=["median", "min", "mean"])
    parser.add_argument(
        "--write-docs",
        action="store_true",
        help="update docs/performance.md, README.md, docs/index.md and docs/img/*.png",
    )
    parser.add_argument("--plots", metavar="DIR", help="write the plots to DIR")
    args = parser.parse_args(argv)
    a = analyse(load(args.json), args.stat)
    print(headline(a))
    print(markdown(a))
    if args.plots:
        for p in plots(a, pathlib.Path(args.plots)):
            print(f"wrote {p}")
    if args.write_docs:
        write_docs(a)
        print("updated docs/performance.md, README.md, docs/index.md and docs/img/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
