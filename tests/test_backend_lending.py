"""--lend-cores' reclaim wait in the supervisor's routing
(``WorkerBackend._dispatch``), step by step, over fakes; and the wait for a
shared prefix that another worker computes, which those reclaim waits once
stretched into a queue.

IN THIS FILE ONLY, ``FakeProcs`` stands in for ``WorkerProcesses`` and
``FakeWorker`` for a worker process (``send`` records the messages instead
of writing to a pipe; nothing reports but the test). The real workers are
in ``tests/test_server_backend.py``'s lending tests.

Checked: a request for an idle worker is sent only once the worker that
borrowed its cores reports its smaller share; a client that leaves during
that wait leaves nothing registered; a second request for the same worker
waits for the same reclaim and is sent after the first; where the workers
outnumber the CPUs (nothing to lend) nothing waits; a request sent to a
worker that has not taken it yet (busy in a step, or waiting for its lent
cores) holds back no other request whose shared prefix the pool already
holds (``FakePool`` stands in for the pool's prefix probe).
"""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from workers import wire
from workers.protocol import SamplingParams
from workers.supervisor import backend as backend_mod
from workers.supervisor.worker_procs import Flight, WorkerProc


class FakeProcs:
    closing = False
    mgr = None                     # no pool: nothing is cached

    def __init__(self, workers, cpus):
        self.workers, self.cpus, self.blas_share = workers, cpus, max(1, cpus // len(workers))

    def live(self):
        return self.workers


class FakeWorker(WorkerProc):
    def __init__(self, idx, threads):
        super().__init__(idx)
        self.sent: list = []
        self.blas_threads = self.blas_threads_running = threads
        self.ready.set()

    def send(self, msg):
        self.sent.append(msg)

    def running(self):
        return True


def make_backend(workers, cpus):
    be = object.__new__(backend_mod.WorkerBackend)
    be.procs = FakeProcs(workers, cpus)
    be.lend_cores, be.handoff_tokens, be.block_size, be.prefill_step = True, 0, 16, 512
    be._changed, be._tasks, be._reclaims = asyncio.Event(), set(), {}
    be._ids = itertools.count(100)
    return be


def lent_pair():
    """2 CPUs, 2 workers: a decodes a request on both (b's core lent), b is idle."""
    a, b = FakeWorker(0, 2), FakeWorker(1, 1)
    be = make_backend([a, b], cpus=2)
    decoding(a, 1)
    return a, b, be


def flight(rid, first=0):
    return Flight(rid, list(range(first, first + 40)), SamplingParams(max_tokens=8), 0)


def decoding(w, rid):
    f = flight(rid, 1000 + rid * 50)
    f.started = True
    w.flights[rid] = f


def report(be, w, threads):
    """The worker's Load: it runs ``threads`` now."""
    be._on(w, wire.Load(w.idx, 1, 0, 0, 0, {}, threads))


def gens(w):
    return [m.id for m in w.sent if isinstance(m, wire.Gen)]


@pytest.mark.timeout(30)
def test_a_request_for_an_idle_worker_waits_for_its_lent_cores():
    async def main():
        a, b, be = lent_pair()
        task = asyncio.ensure_future(be._dispatch(flight(10)))
        await asyncio.sleep(0.05)
        assert [m.n for m in a.sent if isinstance(m, wire.Threads)] == [1]   # told at once
        assert gens(b) == []                       # a has not said it runs 1
        report(be, a, 1)
        await asyncio.wait_for(task, 1)
        assert gens(b) == [10]
    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_client_leaving_during_the_wait_leaves_nothing_registered():
    async def main():
        a, b, be = lent_pair()
        task = asyncio.ensure_future(be._dispatch(flight(10)))
        await asyncio.sleep(0.05)
        assert 10 in b.flights
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert 10 not in b.flights and gens(b) == []
    asyncio.run(main())


@pytest.mark.timeout(30)
def test_a_second_request_for_the_same_worker_is_sent_after_the_first():
    async def main():
        a, b, be = lent_pair()
        decoding(a, 2)                             # b stays the least loaded
        first = asyncio.ensure_future(be._dispatch(flight(10, 100)))
        await asyncio.sleep(0.02)
        second = asyncio.ensure_future(be._dispatch(flight(11, 200)))
        await asyncio.sleep(0.02)
        assert gens(b) == []                       # neither before a gives the core back
        report(be, a, 1)
        await asyncio.wait_for(asyncio.gather(first, second), 1)
        assert gens(b) == [10, 11]
    asyncio.run(main())


@pytest.mark.timeout(30)
def test_with_more_workers_than_cpus_nothing_waits():
    async def main():
        ws = [FakeWorker(i, 1) for i in range(3)]
        be = make_backend(ws, cpus=2)
        decoding(ws[0], 1)
        decoding(ws[1], 2)
        t = time.monotonic()
        await be._dispatch(flight(10))
        assert gens(ws[2]) == [10] and time.monotonic() - t < backend_mod.RECLAIM_WAIT_S / 2
    asyncio.run(main())


class FakePool:
    """Stands in for the pool's prefix probe (``cached_prefix_tokens``): it
    holds the whole blocks of ``prefix``."""

    def __init__(self, prefix, block_size=16):
        self.prefix, self.bs = list(prefix), block_size

    def cached_prefix_tokens(self, tokens, extra=None):
        n = 0
        while n + self.bs <= min(len(tokens), len(self.prefix)) and \
                tokens[n:n + self.bs] == self.prefix[n:n + self.bs]:
            n += self.bs
        return n


SHARED = list(range(500, 532))                     # two blocks every prompt starts with


def chat_flight(rid):
    return Flight(rid, SHARED + list(range(rid * 100, rid * 100 + 8)),
                  SamplingParams(max_tokens=8), 0)


@pytest.mark.timeout(30)
def test_a_request_not_taken_yet_holds_back_no_request_whose_shared_prefix_is_cached():
    """Two requests share their first blocks, which the pool already holds.
    The first goes to a worker that has not taken it yet (busy in a step:
    it reports nothing). The second goes to another worker at once: it
    waits only for blocks some worker will compute, and none will."""
    async def main():
        ws = [FakeWorker(i, 1) for i in range(3)]
        be = make_backend(ws, cpus=3)
        be.lend_cores = False
        be.procs.mgr = FakePool(SHARED)
        decoding(ws[0], 1)
        await asyncio.wait_for(be._dispatch(chat_flight(10)), 1)
        assert gens(ws[1]) == [10]                 # ws[1] says nothing back
        await asyncio.wait_for(be._dispatch(chat_flight(11)), 1)
        assert gens(ws[2]) == [11]
    asyncio.run(main())


@pytest.mark.timeout(30)
def test_requests_waiting_for_lent_cores_hold_back_no_request_whose_prefix_is_cached():
    """The stagger --lend-cores showed on 16 cores: requests for idle
    workers wait for their lent cores; one whose shared prefix is cached
    must not also wait for the first of them to be sent."""
    async def main():
        ws = [FakeWorker(0, 2), FakeWorker(1, 1), FakeWorker(2, 1)]
        be = make_backend(ws, cpus=4)
        be.procs.mgr = FakePool(SHARED)
        decoding(ws[0], 1)                         # ws[0] runs 2 of the 4 cores' threads
        first = asyncio.ensure_future(be._dispatch(chat_flight(10)))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(be._dispatch(chat_flight(11)))
        await asyncio.sleep(0.05)
        assert 11 in ws[2].flights                 # routed, now waiting for cores as well
        report(be, ws[0], 1)
        await asyncio.wait_for(asyncio.gather(first, second), 1)
        assert gens(ws[1]) == [10] and gens(ws[2]) == [11]
    asyncio.run(main())


@pytest.mark.parametrize("cpus, workers, want", [(16, 8, True), (16, 9, False),
                                                 (2, 2, False), (2, 1, True), (1, 1, False)])
def test_lending_is_on_by_default_where_each_worker_has_two_cpus(monkeypatch, cpus, workers,
                                                                 want):
    from workers.supervisor import worker_procs
    monkeypatch.setattr(worker_procs, "cpus_available", lambda: cpus)
    assert worker_procs.lend_cores_by_default(workers) == want


def test_the_backend_takes_the_lending_default_unless_told_or_the_threads_are_set(
        monkeypatch, tmp_path):
    """WorkerBackend's constructor (nothing started): lend_cores=None takes
    the default rule; an explicit choice wins; SHMCACHE_BLAS_THREADS set
    turns lending off whatever was asked."""
    from shmcache.models.demo_model import build_model_dir
    from workers.supervisor import worker_procs
    model = build_model_dir(tmp_path / "m", "llama")
    monkeypatch.delenv("SHMCACHE_BLAS_THREADS", raising=False)
    monkeypatch.setattr(worker_procs, "cpus_available", lambda: 16)
    assert backend_mod.WorkerBackend(model, workers=8).lend_cores is True
    assert backend_mod.WorkerBackend(model, workers=8, lend_cores=False).lend_cores is False
    monkeypatch.setattr(worker_procs, "cpus_available", lambda: 2)
    assert backend_mod.WorkerBackend(model, workers=2).lend_cores is False
    assert backend_mod.WorkerBackend(model, workers=2, lend_cores=True).lend_cores is True
    monkeypatch.setenv("SHMCACHE_BLAS_THREADS", "2")
    assert backend_mod.WorkerBackend(model, workers=2, lend_cores=True).lend_cores is False
