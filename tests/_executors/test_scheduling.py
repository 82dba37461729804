"""The scheduling policy as pure functions, with made-up clock readings.

Every decision of ``_scheduling`` is checked here without a thread or a sleep;
the end-to-end behaviour (real threads, bounded waits) is in test_executor.py.
The docs quote the policy's numbers; the last tests fail when they part.
"""

import pathlib
import re

import pytest

from jax_threadmap._executors import scheduling as policy
from jax_threadmap._executors.scheduling import Measure

ROOT = pathlib.Path(__file__).parents[2]


def test_guided_chunks_take_a_share_of_what_is_left():
    fast = Measure(per_element=1e-9)
    assert policy.chunk_size(1600, 8, fast, limited=False) == 1600 // (
        policy.GUIDED_SHARE * 8
    )
    assert policy.chunk_size(20, 8, fast, limited=False) == 1
    # Fewer than 2 * GUIDED_SHARE elements per worker left: one element each.
    last = 2 * policy.GUIDED_SHARE * 8 - 1
    assert policy.chunk_size(last, 8, fast, limited=False) == 1


@pytest.mark.parametrize("limited", [False, True])
def test_a_guided_map_takes_one_element_until_one_is_timed(limited):
    assert policy.chunk_size(10_000, 8, Measure(), limited=limited) == 1


def test_which_maps_run_in_order_and_which_start_limited():
    w = 8
    large, small = policy.IN_ORDER_UP_TO * w + 1, policy.IN_ORDER_UP_TO * w
    # Asked for: always, whatever the map, its executor or its sums.
    for units in (large, small):
        for on_threads in (True, False):
            for sums in (True, False):
                assert policy.runs_in_order(True, units, w, on_threads, sums)
    # Small maps on threads, not summed: in order without being asked.
    assert policy.runs_in_order(False, small, w, True, False)
    assert not policy.runs_in_order(False, small, w, False, False)
    assert not policy.runs_in_order(False, small, w, True, True)
    assert not policy.runs_in_order(False, large, w, True, False)
    # Limited: large, on threads, more threads than CPUs, not nested.
    for cpus in (2, 7):
        assert policy.starts_limited(large, w, cpus, False, True)
    for cpus in (8, 16):
        assert not policy.starts_limited(large, w, cpus, False, True)
    assert not policy.starts_limited(large, w, 2, nested=True, on_threads=True)
    assert not policy.starts_limited(small, w, 2, False, True)
    assert not policy.starts_limited(large, w, 2, False, on_threads=False)


def test_a_limited_maps_chunks_hold_between_min_and_max_seconds_of_work():
    fast = Measure(per_element=1e-6)
    # The share of what is left, unless that is under MIN_CHUNK_SECONDS of work.
    assert policy.chunk_size(10_000, 8, fast, limited=True) == 625
    assert policy.chunk_size(32, 8, fast, limited=True) == int(
        policy.MIN_CHUNK_SECONDS / 1e-6
    )
    # ... and never more than MAX_CHUNK_SECONDS of work.
    assert policy.chunk_size(10**7, 8, fast, limited=True) == int(
        policy.MAX_CHUNK_SECONDS / 1e-6
    )
    slow = Measure(per_element=1.0)
    assert policy.chunk_size(10**7, 8, slow, limited=True) == 1


def _chunk(measure, per_element, cpu_share=1.0, threads=2, elements=10):
    wall = per_element * elements
    return policy.record_chunk(measure, elements, wall, cpu_share * wall, threads)


def test_slow_elements_get_every_thread_after_slow_votes_chunks_in_a_row():
    m = Measure()
    slow = policy.SLOW_ELEMENT * 2
    votes = [_chunk(m, slow) for _ in range(policy.SLOW_VOTES)]
    assert votes == [False] * (policy.SLOW_VOTES - 1) + [True]
    assert m.per_element == pytest.approx(slow)


def test_one_fast_chunk_resets_the_votes():
    m = Measure()
    slow, fast = policy.SLOW_ELEMENT * 2, policy.SLOW_ELEMENT / 100
    for _ in range(policy.SLOW_VOTES - 1):
        assert not _chunk(m, slow)
    assert not _chunk(m, fast)
    assert m.votes == 0
    assert not _chunk(m, slow)


def test_waiting_elements_vote_by_their_share_of_cpu():
    fast = policy.SLOW_ELEMENT / 100
    m = Measure()
    # Two threads each on a CPU for a fifth of the time: 0.4 of one CPU, waiting.
    share = policy.WAIT_SHARE / 2.5 / 2
    assert [_chunk(m, fast, share) for _ in range(policy.SLOW_VOTES)][-1]
    # Two threads taking turns at the GIL: each half the time, one CPU in all.
    m = Measure()
    assert not any(_chunk(m, fast, 0.5) for _ in range(5 * policy.SLOW_VOTES))


def test_short_maps_of_fast_elements_run_inline():
    fast = Measure(per_element=policy.SLOW_ELEMENT / 10)
    fits = int(policy.INLINE_SECONDS / fast.per_element) - 1
    assert policy.runs_inline(fits, fast, shared=True)
    assert not policy.runs_inline(fits + 2, fast, shared=True)  # too long
    assert not policy.runs_inline(fits, fast, shared=False)  # a user's executor
    assert not policy.runs_inline(1, Measure(), shared=True)  # nothing timed yet
    assert not policy.runs_inline(1, None, shared=True)  # the first map
    slow = Measure(per_element=policy.SLOW_ELEMENT)
    assert not policy.runs_inline(1, slow, shared=True)  # threads pay off


def test_a_map_run_inline_takes_what_fits_in_the_rest_of_its_time():
    m = Measure(per_element=policy.INLINE_SECONDS / 100)
    assert policy.inline_chunk(0.0, m) == 100
    assert policy.inline_chunk(policy.INLINE_SECONDS / 2, m) == 50
    assert policy.inline_chunk(2 * policy.INLINE_SECONDS, m) == 1  # at least one


def test_fixed_chunks_and_vector_lengths():
    per = policy.FIXED_CHUNKS_PER_WORKER
    assert policy.fixed_chunk(100, 5) == -(-100 // (per * 5))
    assert policy.fixed_chunk(0, 5) is None
    vec = policy.VECTOR_CHUNKS_PER_WORKER
    assert policy.vector_chunk_length(1000, 5, 8) == -(-1000 // (vec * 5))
    assert policy.vector_chunk_length(1000, 5, 8, max_chunk=3) == 3
    huge = policy.VECTOR_CHUNK_BYTES
    assert policy.vector_chunk_length(1000, 1, huge // 2) == 2


def test_remote_chunks():
    assert policy.remote_in_flight(4) == policy.REMOTE_IN_FLIGHT_PER_WORKER * 4
    assert policy.remote_in_flight(None) == policy.UNKNOWN_WORKERS_IN_FLIGHT
    assert policy.remote_chunk_size(None, 1000, 8) == 1
    per = policy.TASK_SECONDS_REMOTE / 10
    assert policy.remote_chunk_size(per, 1000, 8) == 10
    assert policy.remote_chunk_size(per, 16, 8) == 2  # an even share of what is left
    # Fast elements: at least MIN_TASK_SECONDS_REMOTE of work per task, not an
    # even share of what is left (each task costs a round trip).
    fast = policy.MIN_TASK_SECONDS_REMOTE / 1000
    assert policy.remote_chunk_size(fast, 4000, 8) >= 999  # not 4000 // 8


# --- the docs quote the numbers ---------------------------------------------------


def _us(seconds):
    return f"{round(seconds * 1e6)} us"


def _ms(seconds):
    return f"{round(seconds * 1e3)} ms"


_WORDS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


def quoted_facts():
    """(file, phrase) per number the docs state: each phrase built from its
    constant, so that changing a constant fails here until the docs follow."""
    mb = policy.VECTOR_CHUNK_BYTES // 2**20
    return [
        ("docs/executors.md", f"(more than {policy.IN_ORDER_UP_TO} elements"),
        ("docs/executors.md", f"at most {policy.IN_ORDER_UP_TO} elements per thread"),
        ("docs/executors.md", f"as soon as {_WORDS[policy.SLOW_VOTES]} chunks in a"),
        ("docs/executors.md", f"slow ({_us(policy.SLOW_ELEMENT)} or more each)"),
        ("docs/executors.md", f"idle for {policy.IDLE_TIMEOUT:g} seconds exits"),
        ("docs/executors.md", f"less than {_ms(policy.INLINE_SECONDS)} in all"),
        ("README.md", f"exit after {policy.IDLE_TIMEOUT:g} s idle"),
        (
            "docs/executors.md",
            f"never more than about {_ms(policy.MAX_CHUNK_SECONDS)} of work",
        ),
        (
            "docs/vectorized.md",
            f"about {_WORDS[policy.VECTOR_CHUNKS_PER_WORKER]} chunks per worker",
        ),
        ("docs/vectorized.md", f"at most about {mb} MB of operands"),
    ]


@pytest.mark.parametrize("path, phrase", quoted_facts())
def test_the_docs_quote_the_policys_numbers(path, phrase):
    text = (ROOT / path).read_text()
    flat = re.sub(r"\s+", " ", text)
    assert re.sub(r"\s+", " ", phrase) in flat, (
        f"{path} no longer says {phrase!r}: update the prose to the constant "
        "in jax_threadmap/_executors/scheduling.py"
    )


def test_slow_elements_cap_every_guided_chunk():
    # A map whose first elements are slow: once timed, a chunk holds at most
    # MAX_CHUNK_SECONDS of work, not a share of what is left (about 150 here).
    slow = Measure(per_element=10 * policy.MAX_CHUNK_SECONDS)
    assert policy.chunk_size(9_000, 32, slow, limited=False) == 1
    fast = Measure(per_element=1e-7)
    assert policy.chunk_size(9_000, 32, fast, limited=False) == 9_000 // 64
    policy.record_time(fast, 10, 10 * policy.MAX_CHUNK_SECONDS)
    assert policy.chunk_size(9_000, 32, fast, limited=False) == 1
