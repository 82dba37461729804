"""The public API's types, as a type checker sees them in a user's script."""

import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parents[1]

# Runs in child processes on the CPU (conftest.py, tests/tpu_suite.sh).
pytestmark = pytest.mark.children


def test_a_user_script_type_checks_strictly_with_precise_results():
    # Was: threadmap, kernel calls and async_call were typed as returning Any,
    # so every assert_type of the script failed.
    pytest.importorskip("mypy")
    pytest.importorskip("typing_extensions")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            # JAX's own functions, some unannotated, are not what is checked.
            "--allow-untyped-calls",
            # Nor the library's insides: what a user's checker sees of them is
            # their signatures. (Without this, a run with no cache reports the
            # package's own modules under --strict; a cached run does not.)
            "--follow-imports=silent",
            "--no-incremental",
            str(HERE / "typing_user_script.py"),
        ],
        cwd=HERE.parent,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
