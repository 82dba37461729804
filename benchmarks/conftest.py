"""Shared fixture of the benchmark suite, and the ratios printed at the end.

Run with ``pytest benchmarks/ --benchmark-only --benchmark-json=FILE``; then
``python benchmarks/report.py FILE`` turns the file into the docs' tables and
plots. The same tables are printed at the end of the run.
"""

from __future__ import annotations

import harness
import pytest
import report

_results: list[dict] = []


@pytest.fixture
def measure(benchmark):
    """Times ``run`` with pytest-benchmark and records what the report needs.

    ``info`` goes into the JSON's ``extra_info``: at least ``case``, ``method``,
    ``elements`` (run per call) and ``batch_elements`` (the batch it stands for).
    """

    def measure(run, *, group: str, rounds: int, warmup: int = 1, **info):
        benchmark.group = group
        with harness.OtherLoad() as load:
            result = benchmark.pedantic(
                run, rounds=rounds, warmup_rounds=warmup, iterations=1
            )
        benchmark.extra_info.update(info, other_cores=load.cores)
        if benchmark.stats:
            _results.append(benchmark.stats.as_dict(include_data=False))
        return result

    return measure


def pytest_terminal_summary(terminalreporter):
    if _results:
        terminalreporter.section("jax_threadmap ratios (median per element)")
        terminalreporter.write_line(report.markdown(report.analyse(_results)))
