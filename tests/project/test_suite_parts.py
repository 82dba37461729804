"""The suite in parts (``--part K/N``, tests/conftest.py; tests/tpu_suite.sh): every
test is in exactly one part, each part holds its share (within one) of every file's
tests, so a slow file is spread over all parts, and a run of the parts runs what a
run of the whole suite runs."""

from __future__ import annotations

import collections
import os
import pathlib
import subprocess
import sys
import textwrap

from conftest import part_of_test
from hypothesis import given
from hypothesis import strategies as st


def deal(sizes: list[int], parts: int) -> list[list[int]]:
    """The part of each test, file by file, for files of ``sizes`` tests."""
    out, index = [], 0
    for size in sizes:
        out.append([part_of_test(index + j, parts) for j in range(size)])
        index += size
    return out


@given(
    st.lists(st.integers(1, 200), min_size=1, max_size=60),
    st.integers(1, 8),
)
def test_each_test_is_in_one_part_and_every_file_is_spread_evenly(sizes, parts):
    where = deal(sizes, parts)
    assert all(0 <= p < parts for file in where for p in file)
    for size, file in zip(sizes, where, strict=True):
        held = collections.Counter(file)
        share = [held.get(p, 0) for p in range(parts)]
        assert max(share) - min(share) <= 1, (size, parts, share)
        assert sum(share) == size
    whole = collections.Counter(p for file in where for p in file)
    share = [whole.get(p, 0) for p in range(parts)]
    assert max(share) - min(share) <= 1, (sizes, parts, share)


def test_one_part_is_the_whole_suite():
    assert deal([5, 7, 1], 1) == [[0] * 5, [0] * 7, [0]]


def test_the_parts_of_a_run_are_the_whole_run(tmp_path):
    # A small suite of two files, collected whole and in 3 parts by pytest
    # itself (with tests/conftest.py's option): the parts hold each test once.
    # One child process runs the four collections (each child imports JAX).
    (tmp_path / "conftest.py").write_text(
        (pathlib.Path(__file__).parents[1] / "conftest.py").read_text()
    )
    for name, n in (("test_a.py", 7), ("test_b.py", 4)):
        (tmp_path / name).write_text(
            textwrap.dedent(
                f"""
                import pytest
                @pytest.mark.parametrize("i", range({n}))
                def test_it(i):
                    pass
                """
            )
        )
    runs = [[], *(["--part", f"{k}/3"] for k in (1, 2, 3))]
    driver = textwrap.dedent(
        f"""
        import sys
        import pytest
        for args in {runs!r}:
            sys.modules.pop("conftest", None)  # each run imports its own
            print("=== run", args, flush=True)
            code = pytest.main(
                ["-q", "-p", "no:xdist", "-p", "no:randomly",
                 "-p", "no:cacheprovider", "--collect-only", *args]
            )
            print("=== exit", int(code), flush=True)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", driver],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    chunks = proc.stdout.split("=== run")[1:]
    assert len(chunks) == 4, proc.stdout + proc.stderr
    assert all("=== exit 0" in c for c in chunks), proc.stdout + proc.stderr
    whole, *parts = ([line for line in c.splitlines() if "::" in line] for c in chunks)
    assert len(whole) == 11
    assert sorted(t for part in parts for t in part) == sorted(whole)
    assert [len(part) for part in parts] == [4, 4, 3]
    assert all(any("test_b.py" in t for t in part) for part in parts)


def test_cpus_seen_sets_the_count_the_package_reads():
    from helpers import cpus_seen

    from jax_threadmap._support.cpus import available_cpus

    machine = available_cpus()
    for n in (1, 16, 64):
        with cpus_seen(n):
            assert available_cpus() == n
            assert os.cpu_count() == n
    assert available_cpus() == machine
