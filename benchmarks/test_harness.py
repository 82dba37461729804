"""The baselines of the demo and benchmarks compute what threadmap computes.

Also checks ``benchmarks/report.py`` on a small synthetic result file, so that
the script that writes the docs' tables cannot rot unnoticed.
"""

import importlib.util
import json
import pathlib

import harness as B
import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("case_name", ["trivial", "sort"])
@pytest.mark.parametrize("method", list(B.RUNNERS))
def test_every_runner_matches_the_reference(case_name, method):
    case = B.CASES[case_name]
    inputs = case.inputs((2, 3, 2))
    got = np.asarray(B.RUNNERS[method](case, inputs)())
    expected = B.reference(case, inputs)
    np.testing.assert_array_equal(got.reshape(expected.shape), expected)


def test_sleep_case_runs_on_its_32_threads():
    case = B.CASES["sleep"]
    assert case.num_workers == 32
    inputs = case.inputs((4, 4))
    np.testing.assert_array_equal(
        np.asarray(B.threadmap_runner(case, inputs)()), inputs.arrays[0]
    )


@pytest.mark.parametrize(
    "shape,limit,expected",
    [
        ((16, 16, 16), 512, (2, 16, 16)),
        ((16, 16, 16), 4096, (16, 16, 16)),
        ((16, 16, 16), 20, (1, 1, 16)),
        ((16, 16, 16), 100, (1, 6, 16)),
        ((65536,), 256, (256,)),
    ],
)
def test_subset_is_a_prefix_with_at_most_limit_elements(shape, limit, expected):
    inputs = B.CASES["trivial"].inputs(shape)
    sub = inputs.subset(limit)
    assert sub.batch_shape == expected
    flat = sub.arrays[0].reshape(-1)
    np.testing.assert_array_equal(flat, np.arange(flat.size))


def test_recipe_broadcasts_unbatched_levels_without_tiling():
    # x mapped at the outer level only, y at the inner level only, core rank 1.
    seen = []

    def kernel(x, y):
        seen.append((x.shape, y.shape))
        return x.sum() * y.sum()

    out = jax.ShapeDtypeStruct((), jnp.float32)
    f = B.threaded_pure_callback(kernel, out, core_ranks=(1, 1), num_threads=2)
    g = jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None))
    x = np.arange(6, dtype=np.float32).reshape(3, 2)
    y = np.arange(8, dtype=np.float32).reshape(4, 2)
    np.testing.assert_allclose(g(x, y), np.outer(x.sum(1), y.sum(1)))
    assert set(seen) == {((2,), (2,))}


def test_peak_memory_is_within_budget_for_a_small_batch():
    result = B.peak_memory("threadmap", batch_shape=(4, 4, 4))
    assert result["elements"] == 64
    assert 0 < result["added_bytes"]
    assert result["budget_bytes"] == 64 * (4 + 2 * 4 * B.MEMORY_ELEMENT_FLOATS)


def _load_report():
    spec = importlib.util.spec_from_file_location(
        "report", ROOT / "benchmarks" / "report.py"
    )
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def _entry(group, method, seconds, elements, batch=4096, **info):
    return {
        "group": group,
        "stats": {"median": seconds, "min": seconds},
        "extra_info": dict(
            method=method,
            elements=elements,
            batch_elements=batch,
            other_cores=0.0,
            **info,
        ),
    }


def test_report_computes_ratios_and_checks_targets():
    report = _load_report()
    e = [
        _entry("compare-sleep", "threadmap", 0.160, 4096, workers=32, title="s"),
        _entry("compare-sleep", "bare_loop", 512 * 1.1e-3, 512),
        _entry("compare-sleep", "sequential", 512 * 1.3e-3, 512),
        _entry("compare-trivial", "threadmap", 4096 * 2e-6, 4096, workers=2),
        _entry("compare-trivial", "bare_loop", 4096 * 1e-6, 4096),
    ]
    e += [
        _entry("scaling-depth", m, n * t, n, depth=d, batch_shape=[n])
        for d, t in ((1, 2e-6), (2, 2.2e-6))
        for m, n in (("threadmap", 65536), ("bare_loop", 65536))
    ]
    a = report.analyse(e)
    sleep = a["compare"]["sleep"]
    ideal = sleep["rows"]["ideal"]["per_element"]
    assert ideal == pytest.approx(1.1e-3 / 32)
    assert sleep["ratios"]["threadmap / ideal"] == pytest.approx((0.160 / 4096) / ideal)
    assert {c["name"]: c["ok"] for c in sleep["checks"]} == {
        "threadmap / ideal": False,
        "sequential / threadmap": True,
    }
    assert a["compare"]["trivial"]["ratios"]["threadmap / bare loop"] == (
        pytest.approx(2.0)
    )
    assert a["depth"]["checks"][0]["value"] == pytest.approx(1.1)
    text = report.markdown(a)
    assert "extrapolated" in text and "NOT met" in text
    assert "| `threadmap` |" in text
    assert report.headline(a).count("\n|") >= 3
    doc = "a\n<!-- benchmarks:x -->\nold\n<!-- /benchmarks:x -->\nb"
    assert "new" in report.replace_region(doc, "x", "new")
    with pytest.raises(ValueError, match="No region"):
        report.replace_region("nothing", "x", "new")


def test_report_puts_small_maps_against_their_loop_with_each_target():
    report = _load_report()
    e = [
        _entry(f"small-map-{n}", "alternating", 1.0, n, batch=n, title="t", **times)
        for n, times in (
            (16, {"threadmap": 12e-6, "loop": 10e-6, "target": 1.1}),
            (128, {"threadmap": 10e-6, "loop": 10e-6, "target": 1.0}),
        )
    ]
    small = report.analyse(e)["small_maps"]
    assert [r["ratio"] for r in small["rows"].values()] == pytest.approx([1.2, 1.0])
    assert [c["ok"] for c in small["checks"]] == [False, True]
    text = report.markdown(report.analyse(e))
    assert "#### Small maps: t, per element" in text and "| 128 |" in text


def test_report_checks_the_operators_row():
    times = {"jax.Array": 10e-6, "landed": 15e-6, "pending": 30e-6}
    ratios = {"landed / jax.Array": 1.5, "pending / jax.Array": 3.0}
    e = [_entry("operators", c, 1.0, 1, case=c, **times, **ratios) for c in "ab"]
    a = _load_report().analyse(e)
    checks = {c["name"]: c["ok"] for c in a["operators"]["checks"]}
    assert checks == {
        "worst landed / jax.Array (`a`)": True,
        "worst pending / jax.Array (`a`)": False,
    }
    text = _load_report().markdown(a)
    assert "| `a` | 10.0 µs | 15.0 µs (1.50x) | 30.0 µs (3.00x) |" in text


def test_fmt_time():
    report = _load_report()
    assert report.fmt_time(2.345e-6) == "2.35 µs"
    assert report.fmt_time(0.0132) == "13.2 ms"
    assert report.fmt_time(4.7) == "4.70 s"
    assert report.fmt_time(150e-9) == "150 ns"


def test_docs_tables_read_without_targets_or_internal_names():
    text = (
        "- threadmap / bare loop = **1.25x** (target <= 1.3: met)\n"
        "- callback_only / hand_threads = 0.61x (for information)\n"
        "- vectorized / hand_threads = **0.98x** (target <= 1.2: NOT met)\n"
        "| thread pool by hand, a block of rows per core (floor) | hand_threads |\n"
    )
    shown = _load_report().for_readers(text)
    assert "target" not in shown and "for information" not in shown
    assert "- the host callback's own cost / thread pool by hand = 0.61x" in shown
    assert "- vectorized / thread pool by hand = **0.98x**" in shown
    assert shown.endswith("| hand_threads |\n")  # table cells are left alone


def test_the_headline_names_the_commit_it_was_measured_at(tmp_path):
    report = _load_report()
    path = tmp_path / "results.json"
    entries = [
        _entry("compare-trivial", "threadmap", 1.0e-3, 4096),
        _entry("compare-trivial", "sequential", 0.5, 4096),
    ]
    path.write_text(
        json.dumps(
            {
                "commit_info": {"id": "0123456789abcdef"},
                "datetime": "2026-12-05T10:00:00",
                "benchmarks": entries,
            }
        )
    )
    text = report.headline(report.analyse(report.load([path])))
    assert "Measured at commit `0123456` (2026-12-05)." in text
