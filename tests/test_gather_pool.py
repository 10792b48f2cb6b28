"""The kept helper threads of large gathers (shmcache/_gather_pool.h).

Through shmcache._gather.gather with threads > 1: every result is compared
byte for byte with the reference loop of test_gather, across many jobs of
different shapes (so helpers move from one job to the next), after pauses
long enough for the helpers to fall asleep, from several calling threads at
once, and in a forked child. Thread counts are read with psutil.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

from test_gather import check_against_reference, make_case, reference

gather = pytest.importorskip("shmcache._gather").gather

# Over one grain (128 KiB), so that a job has grains for a helper to claim.
BIG = dict(chunk=4096, n_ids=48, m=4)


def _big_case(seed):
    rng = np.random.default_rng(seed)
    dst, src, ids, so, do = make_case(rng, BIG["chunk"], BIG["n_ids"], BIG["m"], nsrc=64)
    want = dst.copy()
    reference(want, src, ids, so, do, BIG["chunk"])
    return dst, src, ids, so, do, want


@pytest.mark.timeout(120)
def test_many_jobs_of_different_shapes_in_a_row():
    rng = np.random.default_rng(7)
    for k in range(150):
        chunk = int(rng.choice([64, 128, 1000, 4096]))
        check_against_reference(k, chunk, int(rng.integers(0, 80)), int(rng.integers(1, 9)),
                                int(rng.choice([2, 3, 4, 8])))


@pytest.mark.timeout(60)
def test_jobs_after_the_helpers_fell_asleep():
    # The helpers spin for 0.3 ms after a job, then sleep on the condition
    # variable: 5-20 ms pauses make every other job wake them.
    for k in range(12):
        dst, src, ids, so, do, want = _big_case(k)
        gather(dst, src, ids, so, do, BIG["chunk"], 2)
        assert dst.tobytes() == want.tobytes()
        time.sleep(0.005 * (1 + k % 4))


@pytest.mark.timeout(120)
def test_callers_on_several_threads_at_once():
    # One job at a time uses the pool; the others run theirs alone. Either
    # way every result must be exact.
    errors = []

    def caller(t):
        try:
            for k in range(25):
                dst, src, ids, so, do, want = _big_case(1000 * t + k)
                gather(dst, src, ids, so, do, BIG["chunk"], 2 + t % 3)
                if dst.tobytes() != want.tobytes():
                    errors.append((t, k))
        except Exception as e:       # noqa: BLE001 - reported below
            errors.append((t, repr(e)))

    threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


_COUNTS = textwrap.dedent("""
    import sys
    import psutil
    from shmcache._gather import gather
    sys.path.insert(0, sys.argv[1])
    from test_gather_pool import _big_case
    me = psutil.Process()
    counts = [me.num_threads()]
    for threads in (2, 2, 2, 4, 4, 2, 1):
        for k in range(5):
            dst, src, ids, so, do, want = _big_case(k)
            gather(dst, src, ids, so, do, 4096, threads)
            assert dst.tobytes() == want.tobytes()
        counts.append(me.num_threads())
    print(counts)
""")


@pytest.mark.timeout(120)
def test_helpers_are_kept_not_started_per_call():
    # A fresh interpreter, so no other test has started helpers yet.
    out = subprocess.run([sys.executable, "-c", _COUNTS, os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    c = eval(out.stdout.strip())
    # One helper after threads=2 (kept over the 5 calls), three after 4;
    # never fewer once started, never more than asked for.
    assert c[1:] == [c[0] + 1] * 3 + [c[0] + 3] * 4, c


@pytest.mark.timeout(60)
def test_a_forked_child_starts_its_own_helpers():
    dst, src, ids, so, do, want = _big_case(3)
    gather(dst, src, ids, so, do, BIG["chunk"], 2)      # the parent's helper exists now
    pid = os.fork()
    if pid == 0:                                        # the child: exits, never returns
        code = 1
        try:
            me = psutil.Process()
            before = me.num_threads()                   # fork keeps only this thread
            d2, s2, i2, so2, do2, w2 = _big_case(4)
            gather(d2, s2, i2, so2, do2, BIG["chunk"], 2)
            ok = d2.tobytes() == w2.tobytes() and before == 1 and me.num_threads() == 2
            code = 0 if ok else 2
        finally:
            os._exit(code)
    deadline = time.monotonic() + 50
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's gather hung")
        time.sleep(0.01)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert dst.tobytes() == want.tobytes()


@pytest.mark.timeout(120)
def test_a_caller_held_up_by_its_helper_backs_off_then_comes_back():
    # The test hook makes every helper grain start 5 ms late, as if the
    # helper had been preempted: the caller's final wait then exceeds 50 us
    # and a quarter of the job, and it runs the next 8 jobs alone. Results
    # stay exact throughout.
    from shmcache import _gather as g

    def job(k):
        dst, src, ids, so, do, want = _big_case(k)
        gather(dst, src, ids, so, do, BIG["chunk"], 2)
        assert dst.tobytes() == want.tobytes()

    start = g.pool_stats()
    g._set_helper_delay(5_000_000)
    try:
        for k in range(200):
            job(k)
            if g.pool_stats()["backoffs"] > start["backoffs"]:
                break
        mid = g.pool_stats()
        assert mid["backoffs"] == start["backoffs"] + 1
        for k in range(8):
            job(k)
        after = g.pool_stats()
        assert after["skipped"] == mid["skipped"] + 8     # the 8 jobs ran alone
        assert after["shared"] == mid["shared"]
    finally:
        g._set_helper_delay(0)
    for k in range(40):                                    # no delay: sharing again
        job(k)
    end = g.pool_stats()
    assert end["shared"] > after["shared"]
    with pytest.raises(ValueError, match="delay"):
        g._set_helper_delay(-1)


@pytest.mark.timeout(120)
def test_a_helper_that_had_to_wake_does_not_count_against_it():
    # 5 ms between jobs: the helper has stopped spinning (0.3 ms) and sleeps
    # when each job is posted, so however late it comes (5 ms, by the hook)
    # no job counts towards backing off.
    from shmcache import _gather as g
    start = g.pool_stats()
    g._set_helper_delay(5_000_000)
    try:
        for k in range(10):
            time.sleep(0.005)
            dst, src, ids, so, do, want = _big_case(k)
            gather(dst, src, ids, so, do, BIG["chunk"], 2)
            assert dst.tobytes() == want.tobytes()
    finally:
        g._set_helper_delay(0)
    end = g.pool_stats()
    assert end["backoffs"] == start["backoffs"]
    assert end["shared"] - start["shared"] + end["skipped"] - start["skipped"] == 10
