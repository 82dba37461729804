"""Runs scripts as ``python FILE`` would, from a process that imported JAX once.

A docs block pasted into a fresh file runs in a fresh interpreter. Most of what
that costs is importing JAX, NumPy and jax_threadmap: a docs page's script took
2.9-3.4 s of CPU in a fresh process and 0.7-1.3 s forked (README, derivatives,
faq), and a test run runs about 40 such scripts. So a *zygote* imports them once, before
any JAX backend starts and while it has no thread but the main one, and forks
one child per script; the child takes the script's directory, environment,
``sys.argv``, ``sys.path[0]`` and standard streams, runs the file as
``__main__`` (``runpy.run_path``) in fresh globals, and then ends as an
interpreter does: an uncaught exception prints its traceback and sets status 1,
and ``SystemExit`` unwinds the zygote's own frames, so that ``atexit`` hooks, the
joins of non-daemon threads and the flushes of interpreter shutdown run as they
would after ``python FILE``.

What differs from a fresh interpreter, and how each is kept from hiding a
defect: modules imported by the zygote are already in ``sys.modules`` (a script
still needs its own ``import`` lines: its globals start empty); warnings issued
while they were imported went to the zygote (the zygote checks that it wrote
nothing to stderr, else :func:`run` starts fresh processes); and environment
variables read when JAX is imported (``JAX_*``) are those of the zygote's start,
so there is one zygote per environment (``XLA_FLAGS`` for more devices, or one
that a script sets itself before its first JAX call, is read when the backend
starts, which the zygote never does).
``JAX_THREADMAP_TEST_FRESH_SCRIPTS=processes`` runs every script in a fresh process.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading

ZYGOTE_IMPORTS = ("numpy", "jax", "jax.numpy", "jax_threadmap")

_ZYGOTE = r"""
import json, os, runpy, sys, threading, traceback
for name in json.loads(sys.argv[1]):
    __import__(name)
assert threading.active_count() == 1, threading.enumerate()
control_in, control_out = os.fdopen(0, "r"), os.fdopen(os.dup(1), "w")
sys.stdout.flush()
sys.stderr.flush()
print(json.dumps({"ready": True}), file=control_out, flush=True)


def child(req):
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    control_out.close()
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = [req["file"], *req["args"]]
    sys.path[0] = os.path.dirname(req["file"])
    try:
        runpy.run_path(req["file"], run_name="__main__")
    except SystemExit:
        raise
    except BaseException as e:
        # The traceback from the script's first frame on, as `python FILE` prints it.
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != req["file"]:
            tb = tb.tb_next
        e = e.with_traceback(tb or e.__traceback__)
        sys.excepthook(type(e), e, e.__traceback__)
        raise SystemExit(1)
    raise SystemExit(0)


for line in control_in:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)  # ends this process as the interpreter ends after a script
    print(json.dumps({"pid": pid}), file=control_out, flush=True)
    _, status = os.waitpid(pid, 0)
    reply = {"returncode": os.waitstatus_to_exitcode(status)}
    print(json.dumps(reply), file=control_out, flush=True)
"""


class _Zygote:
    """One zygote per test process, started at its first script."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.lock = threading.Lock()
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ZYGOTE, json.dumps(ZYGOTE_IMPORTS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=self.env,
            text=True,
        )
        ready = self.proc.stdout.readline()
        self.err.seek(0)
        self.usable = bool(ready) and not self.err.read()

    def run(
        self, file: str, cwd: str, env: dict[str, str], timeout: float, args=()
    ) -> subprocess.CompletedProcess:
        with self.lock:
            req = {
                "file": file,
                "args": [str(a) for a in args],
                "cwd": cwd,
                "env": env,
                "stdout": os.path.join(cwd, ".stdout"),
                "stderr": os.path.join(cwd, ".stderr"),
            }
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            pid = json.loads(self.proc.stdout.readline())["pid"]
            reply: list[str] = []
            reader = threading.Thread(
                target=lambda: reply.append(self.proc.stdout.readline()), daemon=True
            )
            reader.start()
            try:
                reader.join(timeout)
            except BaseException:  # pytest-timeout, Ctrl-C: no later script waits
                self._kill(pid)  # behind this one in a zygote that is still busy
                raise
            if not reply or not reply[0]:
                self._kill(pid)
                raise subprocess.TimeoutExpired([file], timeout)
            answer = json.loads(reply[0])
            with open(req["stdout"]) as out, open(req["stderr"]) as err:
                stdout, stderr = out.read(), err.read()
            return subprocess.CompletedProcess(
                [sys.executable, file, *map(str, args)],
                answer["returncode"],
                stdout,
                stderr,
            )

    def _kill(self, pid: int) -> None:
        """Kills the script ``pid`` and this zygote (the next script gets a new one)."""
        for stuck in (pid, self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(stuck, signal.SIGKILL)
        self.proc.wait()


_zygotes: dict[str, _Zygote] = {}


@atexit.register
def _close_zygotes() -> None:
    """Ends each zygote (its loop stops at the end of its input) and waits for it."""
    for zygote in _zygotes.values():
        with contextlib.suppress(OSError):
            zygote.proc.stdin.close()
        try:
            zygote.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            zygote.proc.kill()


#: Variables that differ from test to test and that nothing the zygote imports
#: reads: pytest names the running test in PYTEST_CURRENT_TEST. A zygote keyed by
#: them would be a new one (a JAX import, about 1 s of CPU) for every script.
NOT_READ_AT_IMPORT = frozenset({"PYTEST_CURRENT_TEST"})


def zygote_key(env: dict[str, str]) -> str:
    """Which zygote serves a script run with ``env``: one per environment as the
    zygote's imports see it (the child itself gets ``env`` whole)."""
    return json.dumps({k: env[k] for k in sorted(env) if k not in NOT_READ_AT_IMPORT})


def run(file: str, cwd: str, env: dict[str, str], timeout: float = 600, args=()):
    """Runs ``python FILE ARGS`` in ``cwd`` with ``env`` (forked from the zygote
    started with ``env``). Returns a ``CompletedProcess``."""
    mode = os.environ.get("JAX_THREADMAP_TEST_FRESH_SCRIPTS", "fork")
    if mode not in ("fork", "processes"):
        raise ValueError(
            "JAX_THREADMAP_TEST_FRESH_SCRIPTS must be 'fork' or 'processes', "
            f"got {mode!r}"
        )
    if mode == "fork" and hasattr(os, "fork"):
        key = zygote_key(env)
        zygote = _zygotes.get(key)
        if zygote is None or zygote.proc.poll() is not None:  # new, or killed
            zygote = _zygotes[key] = _Zygote(env)
        if zygote.usable:
            return zygote.run(file, cwd, env, timeout, args)
    return subprocess.run(
        [sys.executable, file, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=timeout,
    )
