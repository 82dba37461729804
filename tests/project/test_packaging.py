"""The wheel and the sdist carry what the metadata promises (the license text), and
importing the package starts nothing."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest
from helpers import run_script

ROOT = pathlib.Path(__file__).resolve().parents[2]

# Runs in child processes on the CPU (conftest.py, tests/tpu_suite.sh).
pytestmark = pytest.mark.children


def test_license_file_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert (
        "Apache License\n                           Version 2.0, January 2004" in text
    )
    assert "END OF TERMS AND CONDITIONS" in text
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '\nlicense = "Apache-2.0"\nlicense-files = ["LICENSE"]\n' in pyproject


def test_wheel_and_sdist_ship_the_license(tmp_path):
    if importlib.util.find_spec("hatchling") is None:
        pytest.skip("hatchling is not installed (pip install '.[test]')")
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-d", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("*.whl")
    (sdist,) = tmp_path.glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (license_file,) = [
            n for n in names if n.endswith(".dist-info/licenses/LICENSE")
        ]
        assert zf.read(license_file) == (ROOT / "LICENSE").read_bytes()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        assert "License-Expression: Apache-2.0" in zf.read(metadata).decode()
    with tarfile.open(sdist) as tf:
        top = tf.getnames()[0].split("/")[0]
        assert (
            tf.extractfile(f"{top}/LICENSE").read() == (ROOT / "LICENSE").read_bytes()
        )


_IMPORT_ONLY = """
import atexit, sys
from jax._src import xla_bridge

def report():  # registered first: runs after every exit hook of the package
    print("backends", sorted(xla_bridge._backends), flush=True)

atexit.register(report)
import jax_threadmap
"""


@pytest.mark.parametrize("platforms", ["cpu", "cuda"])
def test_importing_the_package_starts_no_backend_even_at_exit(platforms):
    # On a TPU host a backend started at exit opens the chip (15 s, and takes it
    # from the parent of a child that only imported the package); with a
    # platform that cannot start, it printed a traceback.
    proc = run_script(_IMPORT_ONLY, env={"JAX_PLATFORMS": platforms})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "backends []\n", (proc.stdout, proc.stderr)
    assert proc.stderr == "", proc.stderr
