"""threadmap in multi-process JAX: 2 processes on 127.0.0.1, 2 CPU devices each.

The checks live in ``multiprocess_checks.py``; this test starts both processes
(``jax.distributed.initialize`` with a free port), bounds their time, and reads
what each printed: ``shard_map``, sharded ``jit``, ``grad``, ``async_call`` and
``async_array_from_callback`` (each process fetching only its own shards)
checked against NumPy, each process's elements run on its own threads, and a
kernel that raises in one process only. At the end, process 1 lets a kernel's
error go uncaught: it exits with that error, and process 0 exits cleanly, both
promptly (no process waits for good on a peer that failed).
"""

import pathlib
import socket
import subprocess
import time

import pytest
from helpers import LOOPBACK, NO_LOOPBACK, start_script

pytestmark = pytest.mark.skipif(not LOOPBACK, reason=f"jax.distributed {NO_LOOPBACK}")

HERE = pathlib.Path(__file__).parents[1]
#: Seconds both processes may take, from start to exit (about 20 s on 2 busy CPUs).
LIMIT = 150


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(LIMIT + 30)
def test_two_processes_map_their_own_shards_and_exit_promptly():
    port = free_port()
    checks = HERE / "multiprocess_checks.py"
    procs = [start_script(checks, port, i) for i in range(2)]
    deadline = time.monotonic() + LIMIT
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
            outputs.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        report = [p.communicate() for p in procs]
        pytest.fail(f"the processes did not exit within {LIMIT} s: {report}")
    (rc0, out0, err0), (rc1, out1, err1) = outputs
    for out, err in ((out0, err0), (out1, err1)):
        assert "all multiprocess checks passed" in out, out + err[-5000:]
        assert sum(line.startswith("ok ") for line in out.splitlines()) == 21, out
    assert rc0 == 0, out0 + err0[-5000:]
    # Process 1 failed with its kernel's error, naming the batch index (within
    # its shard) and the line that raised.
    assert rc1 == 1, out1 + err1[-5000:]
    assert "KernelError: threadmap kernel 'sort_scaled' at batch index (0,)" in err1, (
        err1[-5000:]
    )
    assert "ValueError: row starting 14.0 in process 1" in err1, err1[-5000:]
