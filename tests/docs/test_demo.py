"""``python -m examples.demo``: the jaxpr, the table, the plot and the options."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # examples/ lives beside the package, not in it
    sys.path.insert(0, str(ROOT))

from examples import demo as _demo  # noqa: E402

QUICK = ["--size", "4", "--threads", "1,2"]


def run_demo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "examples.demo", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def quick_run():
    proc = run_demo(*QUICK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_demo_prints_one_threadmap_equation(quick_run):
    out = quick_run.stdout
    assert out.count("threadmap[") == 1
    assert "pure_callback" not in out.split("->")[0]  # the jaxpr has no callback
    assert "-> 1 `threadmap` equation for 3 nested vmaps." in out
    assert "spec=BatchSpec(shape=(4, 4, 4)" in out


def test_demo_table_has_numbers_and_speedups(quick_run):
    out = quick_run.stdout
    number = r"\d+\.\d+"
    row = rf"\s+(\d+)\s+({number})s\*?\s+{number} ms\s+({number})x"
    (sequential,) = re.findall(rf"pure_callback sequential{row}", out)
    rows = re.findall(rf"threadmap{row}", out)
    assert [int(threads) for threads, _, _ in rows] == [1, 2]
    # Each speedup is the sequential wall time over the row's (as printed: 3
    # decimals of seconds, 1 of the ratio).
    base = float(sequential[1])
    for _, seconds, speedup in rows:
        low = (base - 5e-4) / (float(seconds) + 5e-4)
        high = (base + 5e-4) / max(float(seconds) - 5e-4, 1e-9)
        assert low - 0.05 <= float(speedup) <= high + 0.05, (base, seconds, speedup)
    assert "Results match pure_callback: True." in out


def test_demo_table_speedups_are_against_the_sequential_row():
    rows = [
        ("pure_callback sequential", 1, 64, 2.0, None),
        ("threadmap", 1, 64, 1.0, None),
        ("threadmap", 2, 32, 0.5, None),
    ]
    table = _demo.format_table(rows, 64, cpus=2)
    speedups = re.findall(r"(\d+\.\d)x", table)
    assert speedups == ["1.0", "2.0", "4.0"]
    assert "* timed on the first 32 elements, extrapolated to 64: threadmap (2)." in (
        table
    )


def test_demo_shows_progress_on_stderr(quick_run):
    assert "[1/3] pure_callback sequential on 64 elements ..." in quick_run.stderr
    assert "[3/3] threadmap, 2 threads, 64 elements ..." in quick_run.stderr


def test_demo_writes_a_png_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "speedup.png"
    proc = run_demo("--kernel", "sleep", *QUICK, "--plot", str(path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"Wrote {path}." in proc.stdout


def test_help_explains_the_options(capsys):
    with pytest.raises(SystemExit) as e:
        _demo.main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for option in ("--kernel", "--size", "--threads", "--rounds", "--plot"):
        assert option in text


@pytest.mark.parametrize(
    "argv", [["--threads", "0"], ["--threads", "a,b"], ["--size", "0"]]
)
def test_bad_options_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as e:
        _demo.main(argv)
    assert e.value.code == 2
    assert "usage:" in capsys.readouterr().err


def test_default_thread_counts_reach_past_the_cpus(monkeypatch):
    monkeypatch.setattr(_demo, "available_cpus", lambda: 2)
    assert _demo.default_threads("sort") == [1, 2, 4]
    monkeypatch.setattr(_demo, "available_cpus", lambda: 6)
    assert _demo.default_threads("sort") == [1, 2, 4, 6, 12]
    assert _demo.default_threads("sleep") == [1, 4, 16, 32]


def test_table_states_rounds_extrapolation_and_load():
    rows = [
        ("pure_callback sequential", 1, 256, 10.0, 0.0),
        ("threadmap", 1, 512, 8.0, None),
        ("threadmap", 2, 512, 4.0, 1.3),
    ]
    text = _demo.format_table(rows, 4096, 2, rounds=3)
    lines = text.splitlines()
    assert "Median of 3 rounds per row." in text
    assert "* timed on the first 256 elements, extrapolated to 4096" in text
    assert (
        "first 512 elements, extrapolated to 4096: threadmap (1), threadmap (2)" in text
    )
    assert [line.endswith("†") for line in lines if "threadmap  " in line] == [
        False,
        True,
    ]
    assert "† taken while other processes kept up to 1.3 of the 2 CPUs busy" in text
    assert "2.5x†" in text  # speedup 10 / 4
