"""JAX's own tests of ``jit`` and of ``jax.Array`` methods, with pending inputs.

Runs a selection of JAX's test suite twice (issue 48 item 4): as written
("plain"), and with every array input a pending ``AsyncArray`` ("pending": deferred
dispatch, the one mechanism); then prints each run's pass count and every test
whose outcome differs from the plain run, with the first line of its error.

JAX's tests are not part of this repository: the runner takes a folder holding
them, or extracts them from a JAX git checkout at a tag that matches the
installed JAX (``--jax-git``), into a temporary folder. They need ``absl-py``
(``pip install absl-py``).

"Pending inputs" (:mod:`jax_suite_plugin`, loaded into each run): every
``jax.Array`` or NumPy array passed to a ``jax.jit`` function (not its static
arguments), and every array that the test makes with ``jax.device_put``,
``jnp.array``, ``jnp.arange``, ``jnp.zeros`` or ``jnp.ones``
outside a trace, becomes an ``AsyncArray`` whose load returns the value a
millisecond later, on the same devices.

Usage::

    python benchmarks/jax_suite.py --jax-git /path/to/jax --ref jax-v0.10.2
    python benchmarks/jax_suite.py --tests /tmp/jax_tests   # api_test.py, ...
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
#: The files of JAX's suite that are run, and what of each.
FILES = ("api_test.py", "array_test.py")
SELECTION = (
    "api_test.py::JitTest",
    "api_test.py::APITest",
    "array_test.py::JaxArrayTest",
)
#: Of APITest, the tests of device_put, block_until_ready and arrays.
KEYWORDS = "JitTest or JaxArrayTest or device_put or block_until_ready or array"
#: ``pending``: deferred dispatch (the default); ``blocking``: the same inputs with
#: ``JAX_THREADMAP_ASYNC_DISPATCH=0`` (a call on pending data waits at dispatch).
MODES = ("plain", "pending", "blocking")


def extract(jax_git: str, ref: str, into: pathlib.Path) -> None:
    """Writes JAX's test files at ``ref`` of the git directory ``jax_git``."""
    for name in FILES:
        text = subprocess.run(
            ["git", "-C", jax_git, "show", f"{ref}:tests/{name}"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        (into / name).write_text(text)


def run(tests: pathlib.Path, mode: str, timeout: float) -> dict[str, tuple[str, str]]:
    """Runs the selection in ``mode``; test id -> (outcome, first error line).

    A test that hangs (``timeout`` seconds; pytest-timeout's thread method ends
    the process) is recorded as ``timeout`` and the run goes on without it."""
    log = tests / f"log-{mode}.txt"
    log.unlink(missing_ok=True)
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), str(HERE), env.get("PYTHONPATH")) if p
    )
    env.pop("JAX_THREADMAP_ASYNC_DISPATCH", None)
    env["JAX_SUITE_LOG"] = str(log)
    if mode != "plain":
        env["JAX_SUITE_PENDING"] = "1"
    if mode == "blocking":
        env["JAX_THREADMAP_ASYNC_DISPATCH"] = "0"
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    argv += ["-p", "no:xdist", "-p", "no:randomly", "-p", "jax_suite_plugin"]
    argv += ["-k", KEYWORDS, "-o", "addopts=", "--rootdir", str(tests)]
    argv += [f"--timeout={timeout}", "-o", "timeout_method=thread"]
    argv += [str(tests / s) for s in SELECTION]
    while True:
        found, hung = outcomes(log)
        if hung is not None:
            with log.open("a") as f:
                f.write(f"timeout\t{hung}\tno outcome within {timeout} s\n")
            found[hung] = ("timeout", "")
        deselect = [f"--deselect={name}" for name in found]
        done = subprocess.run(argv + deselect, cwd=tests, env=env, capture_output=True)
        if outcomes(log)[1] is None:  # ended normally
            return _by_test(outcomes(log)[0])
        del done


def _by_test(found: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    return {name.split("::", 1)[1]: v for name, v in found.items()}


def outcomes(log: pathlib.Path) -> tuple[dict[str, tuple[str, str]], str | None]:
    """Test id -> (passed|failed|skipped|timeout, first error line), and the test
    that started last without an outcome (``None``: none)."""
    found: dict[str, tuple[str, str]] = {}
    started = None
    if not log.exists():
        return found, None
    for line in log.read_text().splitlines():
        kind, name, *rest = line.split("\t") + [""]
        if kind == "start":
            started = name
            continue
        found[name] = (kind, rest[0])
        if name == started:
            started = None
    return found, started


def summary(results: dict[str, dict[str, tuple[str, str]]]) -> str:
    """Pass counts per mode, and every test whose outcome differs from plain."""
    lines = []
    for mode, found in results.items():
        counts = {
            k: sum(v[0] == k for v in found.values())
            for k in ("passed", "failed", "skipped")
        }
        lines.append(
            f"{mode:9s} passed {counts['passed']}, failed {counts['failed']}, "
            f"skipped {counts['skipped']} (of {len(found)})"
        )
    plain = results.get("plain", {})
    for mode, found in results.items():
        if mode == "plain":
            continue
        lines.append(f"\n{mode}: differences from the plain run")
        for name in sorted(found):
            want = plain.get(name, ("absent", ""))[0]
            if found[name][0] != want:
                lines.append(f"  {name}: {want} -> {found[name][0]}  {found[name][1]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", help="a folder holding JAX's api_test.py, ...")
    parser.add_argument("--jax-git", help="a JAX git directory to extract them from")
    parser.add_argument("--ref", help="the tag to extract (e.g. jax-v0.10.2)")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--timeout",
        type=float,
        default=120,
        help="seconds per test before it counts as hung",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.tests:
            tests = pathlib.Path(args.tests)
        elif args.jax_git and args.ref:
            tests = pathlib.Path(tmp)
            extract(args.jax_git, args.ref, tests)
        else:
            parser.error("give --tests DIR, or --jax-git DIR and --ref TAG")
        results = {m: run(tests, m, args.timeout) for m in args.modes.split(",")}
        if "plain" not in results and (tests / "log-plain.txt").exists():
            plain = outcomes(tests / "log-plain.txt")[0]  # from an earlier run
            results = {"plain": _by_test(plain), **results}
        print(summary(results))


if __name__ == "__main__":
    main()
