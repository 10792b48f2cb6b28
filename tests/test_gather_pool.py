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

from test_gather import I64, check_against_reference, make_case, reference

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


class _Long:
    """A 32 MiB gather in 64 KiB chunks (2 ms or more on one thread), built
    once: long enough that a helper woken from sleep joins it before the
    caller is done. check() runs it on two threads and compares."""

    def __init__(self, chunk=64 << 10, n=512):
        rng = np.random.default_rng(11)
        self.chunk = chunk
        self.src = rng.integers(0, 256, (n + 8) * chunk, dtype=np.uint8)
        self.ids = rng.permutation(n + 8)[:n].astype(np.int64)
        self.want = self.src.reshape(n + 8, chunk)[self.ids].ravel()
        self.dst = np.empty_like(self.want)

    def check(self):
        self.dst[:] = 0
        gather(self.dst, self.src, self.ids, I64(0), I64(0), self.chunk, 2)
        assert np.array_equal(self.dst, self.want)


def _backoff_scenario():
    # The test hook makes every helper grain start 20 ms late, as if the
    # helper had been preempted: a judged job's final wait then exceeds
    # 50 us and a quarter of the job, and the caller runs the next 8 alone;
    # the job after those (the helper asleep by then) is not judged, the
    # one after it is, and a second bad job in a row doubles the count.
    # Results stay exact throughout.
    from shmcache import _gather as g
    job = _Long()
    job.check()                                   # helper started (not judged)
    g._set_helper_delay(20_000_000)
    try:
        def counts():
            c = g.pool_stats()
            return c["shared"], c["skipped"], c["backoffs"]

        s0, k0, b0 = counts()
        job.check()                               # judged, bad
        assert counts() == (s0 + 1, k0, b0 + 1)
        for _ in range(8):
            job.check()
        assert counts() == (s0 + 1, k0 + 8, b0 + 1)     # the 8 ran alone
        job.check()                               # the first after: not judged
        assert counts() == (s0 + 2, k0 + 8, b0 + 1)
        job.check()                               # judged, bad again: 16 alone
        assert counts() == (s0 + 3, k0 + 8, b0 + 2)
        for _ in range(16):
            job.check()
        assert counts() == (s0 + 3, k0 + 24, b0 + 2)
    finally:
        g._set_helper_delay(0)
    # Without the delay the helper is back in use: the job after the 16 is
    # not judged, the next ones are good (on a busy machine one might still
    # be bad, hence a few tries rather than exact counts).
    for _ in range(60):
        job.check()
        if counts()[0] >= s0 + 6:
            break
    assert counts()[0] >= s0 + 6
    print("ok")


@pytest.mark.timeout(120)
def test_a_caller_held_up_by_its_helper_backs_off_then_comes_back():
    # In a fresh interpreter: other tests leave the pool part way through a
    # back-off, which would shift every count below.
    code = ("import sys; sys.path.insert(0, sys.argv[1]); "
            "from test_gather_pool import _backoff_scenario; _backoff_scenario()")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_helper_delay_hook_checks_its_argument():
    from shmcache import _gather as g
    with pytest.raises(ValueError, match="delay"):
        g._set_helper_delay(-1)
    with pytest.raises(ValueError, match="delay"):
        g._set_helper_delay(10 ** 9)
