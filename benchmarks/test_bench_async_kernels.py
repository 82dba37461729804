"""``async def`` kernels against the same kernel on threads: many waiting elements.

Two cases, elements of a wait of WAIT_S under ``jit(vmap)``:

1. **sleep**, N elements: the kernel awaits ``asyncio.sleep(WAIT_S)`` (async) or
   calls ``time.sleep(WAIT_S)`` (threads);
2. **server**, SERVER_ELEMENTS elements: the kernel sends its index to a real
   TCP server on 127.0.0.1 and reads the answer (``asyncio.open_connection`` /
   ``socket.create_connection``). The server, a plain asyncio server (no aiohttp
   needed) in a process of its own, waits WAIT_S per request before it answers;
   the benchmark starts it and stops it.

Sides: the async kernel with ``max_in_flight=N`` (every element at once; sleep
case only) and with the default bound (2,048); the plain kernel on
``executor=None`` (the shared pool: one thread per CPU; on SLOW_ELEMENTS elements
only, and its time scaled to all, or it would take minutes) and on a
``ThreadPoolExecutor(256)``.

Each side runs in a fresh process (so that peak memory and threads are its own):
the best wall time of ROUNDS maps, the most threads alive during a map (sampled by
the kernel), the threads started from the first map on, and the peak resident
memory above the process's before the first map. For the async side also the
map's fixed cost, the same N elements awaiting ``asyncio.sleep(0)``, and the
target: N waits of WAIT_S in at most 1.5x (WAIT_S + that fixed cost).

Run:
    pytest benchmarks/test_bench_async_kernels.py -s
    python benchmarks/test_bench_async_kernels.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

N = 10_000
WAIT_S = 0.05
ROUNDS = int(os.environ.get("ROUNDS", 3))
#: Elements for the default executor (one thread per CPU): 10,000 waits of 50 ms
#: on 2 threads would take 250 s a round.
SLOW_ELEMENTS = 200
#: Elements of the server case: 10,000 connections at once would overflow the
#: server's accept queue (``somaxconn``, often 4,096), and a refused SYN is
#: retried after a second or more, which measures TCP, not the map.
SERVER_ELEMENTS = 2000
#: Each side runs this many times, in a fresh process each, the sides alternated
#: run by run; the best run of each side is reported.
REPEATS = int(os.environ.get("REPEATS", 2))
SIDES = {
    "sleep": ("async_all", "async_default", "threads_default", "threads_256"),
    "server": ("async_default", "threads_default", "threads_256"),
}


# --- the server (a process of its own) -----------------------------------------------


def serve() -> None:
    """Answers each line ``i`` with ``2 i`` after WAIT_S; prints its port."""
    import asyncio

    async def handle(reader, writer):
        line = await reader.readline()
        await asyncio.sleep(WAIT_S)
        writer.write(f"{2 * float(line)}\n".encode())
        await writer.drain()
        writer.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=4096)
        print(server.sockets[0].getsockname()[1], flush=True)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)  # until the parent closes it

    asyncio.run(main())


class Server:
    """The server process, started on enter and stopped on exit."""

    def __enter__(self) -> int:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        return int(self.proc.stdout.readline())

    def __exit__(self, *exc: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --- one side, in a process of its own ---------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def kernels(case: str, port: int) -> tuple:
    """The async and the plain kernel of ``case``, and the peak-thread sampler."""
    import asyncio
    import socket
    import threading

    peak = [0]

    def sample() -> None:
        peak[0] = max(peak[0], threading.active_count())

    if case == "sleep":

        async def async_kernel(i):
            sample()
            await asyncio.sleep(WAIT_S)
            return i * 2

        def plain_kernel(i):
            sample()
            time.sleep(WAIT_S)
            return i * 2

    else:

        async def async_kernel(i):
            sample()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"{float(i)}\n".encode())
            answer = await reader.readline()
            writer.close()
            return float(answer)

        def plain_kernel(i):
            sample()
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(f"{float(i)}\n".encode())
                answer = s.makefile().readline()
            return float(answer)

    return async_kernel, plain_kernel, peak


def run_side(side: str, case: str, port: int) -> dict[str, float]:
    import asyncio
    import concurrent.futures
    import threading

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_threadmap import threadmap

    async_kernel, plain_kernel, peak = kernels(case, port)
    spec = jax.ShapeDtypeStruct((), jnp.float32)
    full = N if case == "sleep" else SERVER_ELEMENTS
    n = SLOW_ELEMENTS if side == "threads_default" else full
    if side == "async_all":
        kernel, kw = async_kernel, {"max_in_flight": N}
    elif side == "async_default":
        kernel, kw = async_kernel, {}
    elif side == "threads_default":
        kernel, kw = plain_kernel, {}
    else:
        kernel, kw = (
            plain_kernel,
            {"executor": concurrent.futures.ThreadPoolExecutor(256)},
        )
    f = jax.jit(jax.vmap(lambda i: threadmap(kernel, spec, i, **kw)))
    x = jnp.arange(n, dtype=jnp.float32)
    started = [0]
    start = threading.Thread.start

    def counting_start(self):  # threads started from the first map on
        started[0] += 1
        start(self)

    threading.Thread.start = counting_start  # type: ignore[method-assign]
    base_threads = threading.active_count()
    base_rss = _rss()
    out = f(x).block_until_ready()  # compiles; checks the values
    assert np.array_equal(np.asarray(out), np.arange(n) * 2), out
    best = float("inf")
    for _ in range(ROUNDS):
        t = time.perf_counter()
        f(x).block_until_ready()
        best = min(best, time.perf_counter() - t)
    result = {
        "elements": n,
        "full": full,
        "wall": best * full / n,  # scaled to every element (threads_default only)
        "peak_threads": peak[0],
        "base_threads": base_threads,
        "threads_started": started[0],
        "peak_mb": (_peak_rss() - base_rss) / 2**20,
    }
    if side == "async_all":

        async def no_wait(i):
            await asyncio.sleep(0)
            return i * 2

        fixed = jax.jit(jax.vmap(lambda i: threadmap(no_wait, spec, i, **kw)))
        one = jax.jit(jax.vmap(lambda i: threadmap(kernel, spec, i, **kw)))
        fixed(x).block_until_ready()
        one(x[:1]).block_until_ready()
        result["fixed"] = result["one"] = float("inf")
        for _ in range(ROUNDS):
            for name, g, arg in (("fixed", fixed, x), ("one", one, x[:1])):
                t = time.perf_counter()
                g(arg).block_until_ready()
                result[name] = min(result[name], time.perf_counter() - t)
    return result


# --- in this process -----------------------------------------------------------------


def _child(*args: str) -> dict[str, float]:
    import harness  # here: the child runs this file too, and needs none of it

    return harness.script_in_child(__file__, *args, devices=1, timeout=900)


def compare() -> dict[str, dict[str, dict[str, float]]]:
    results: dict[str, dict[str, dict[str, float]]] = {}
    with Server() as port:
        for _ in range(REPEATS):
            for case, sides in SIDES.items():
                for side in sides:
                    r = _child("--side", side, case, str(port))
                    best = results.setdefault(case, {}).get(side)
                    if best is None or r["wall"] < best["wall"]:
                        results[case][side] = r
    return results


def report(results: dict[str, dict[str, dict[str, float]]]) -> str:
    load = os.getloadavg()[0]
    lines = [
        f"{os.cpu_count()} CPUs, load average {load:.2f}; elements of a "
        f"{WAIT_S * 1e3:.0f} ms wait under jit(vmap), best of {REPEATS} processes "
        f"of {ROUNDS} maps",
        "| case | elements | side | wall (s) | peak threads alive | threads "
        "started | peak memory (MB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for case, sides in results.items():
        for side, r in sides.items():
            scaled = (
                f" (from {r['elements']:.0f})" if r["elements"] != r["full"] else ""
            )
            lines.append(
                f"| {case} | {r['full']:.0f} | {side} | {r['wall']:.3f}{scaled} | "
                f"{r['peak_threads']:.0f} | {r['threads_started']:.0f} | "
                f"{r['peak_mb']:.0f} |"
            )
        if "async_all" not in sides:
            continue
        a = sides["async_all"]
        target = WAIT_S + a["fixed"]
        lines.append(
            f"{case}: one element {a['one'] * 1e3:.1f} ms, the map's fixed cost "
            f"({N} elements awaiting sleep(0)) {a['fixed'] * 1e3:.1f} ms; async "
            f"{a['wall'] * 1e3:.1f} ms = {a['wall'] / target:.2f}x (wait + fixed "
            "cost), target <= 1.5"
        )
    return "\n".join(lines)


def test_async_kernels(benchmark):
    benchmark.group = "async def kernels"
    result = benchmark.pedantic(compare, rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print("\n" + report(result))


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    elif sys.argv[1:2] == ["--side"]:
        side, case, port = sys.argv[2:5]
        print(json.dumps(run_side(side, case, int(port))))
    else:
        print(report(compare()))
