"""OpenIndex (shmcache.shm.index): linear probing with backward-shift deletion,
over a small int32 memoryview and a fake key store."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shmcache.shm.index import OpenIndex


class Store:
    """entry id -> (key, home). The index only stores entry ids."""

    def __init__(self, capacity: int = 8):
        self.arr = np.full(capacity, -1, dtype=np.int32)
        self.keys: dict = {}
        self.homes: dict = {}
        self.idx = OpenIndex(memoryview(self.arr), lambda e: self.homes[e],
                             lambda e, key: self.keys[e] == key)

    def add(self, entry: int, key, home: int) -> None:
        self.keys[entry] = key
        self.homes[entry] = home
        self.idx.insert(entry, home)

    def drop(self, entry: int) -> bool:
        return self.idx.remove(entry, self.homes[entry])

    def slots(self) -> list:
        return self.arr.tolist()


def reachable(s: Store, entry: int) -> bool:
    """The invariant: an entry is reachable from its home without crossing an empty slot."""
    m = len(s.arr) - 1
    i = s.homes[entry] & m
    while s.arr[i] >= 0:
        if s.arr[i] == entry:
            return True
        i = (i + 1) & m
    return False


def test_insert_and_find_at_home_slot():
    s = Store(8)
    s.add(3, "k3", 2)
    assert s.slots()[2] == 3
    assert s.idx.find("k3", 2) == 3
    assert s.idx.find("other", 2) == -1
    assert s.idx.find("k3", 5) == -1     # wrong home, empty slot: not found
    assert s.idx.count() == 1


def test_collisions_probe_linearly():
    s = Store(8)
    s.add(1, "a", 3)
    s.add(2, "b", 3)
    s.add(3, "c", 3)
    assert s.slots()[3:6] == [1, 2, 3]
    assert [s.idx.find(k, 3) for k in "abc"] == [1, 2, 3]
    assert s.idx.find("d", 3) == -1


def test_home_uses_low_bits_of_a_large_hash():
    s = Store(8)
    big = (1 << 63) + 5
    s.add(4, "x", big)
    assert s.slots()[5] == 4
    assert s.idx.find("x", big) == 4


def test_wraparound_at_end_of_table():
    s = Store(8)
    s.add(1, "a", 6)
    s.add(2, "b", 6)
    s.add(3, "c", 6)     # 6, 7, then wraps to 0
    s.add(4, "d", 7)     # 7 taken, 0 taken -> 1
    assert s.slots()[6] == 1 and s.slots()[7] == 2 and s.slots()[0] == 3 and s.slots()[1] == 4
    for e, k, h in ((1, "a", 6), (2, "b", 6), (3, "c", 6), (4, "d", 7)):
        assert s.idx.find(k, h) == e


def test_find_all_returns_every_entry_with_the_key():
    s = Store(16)
    s.add(1, "same", 4)
    s.add(2, "other", 4)
    s.add(3, "same", 4)
    s.add(4, "same", 5)  # lands after the cluster, still in the probe run from 4
    assert sorted(s.idx.find_all("same", 4)) == [1, 3, 4]
    assert s.idx.find_all("other", 4) == [2]
    assert s.idx.find_all("none", 4) == []
    assert s.idx.find("same", 4) == 1  # find returns the first


def test_remove_shifts_back_the_cluster():
    s = Store(8)
    s.add(1, "a", 3)
    s.add(2, "b", 3)
    s.add(3, "c", 4)  # home 4, stored at 5
    assert s.drop(1)
    # no tombstones: the cluster moved back and everything is still found
    assert -1 not in s.slots()[3:5]
    assert s.idx.find("a", 3) == -1
    assert s.idx.find("b", 3) == 2
    assert s.idx.find("c", 4) == 3
    assert s.idx.count() == 2


def test_remove_does_not_move_entry_before_its_home():
    s = Store(8)
    s.add(1, "a", 2)   # slot 2
    s.add(2, "b", 3)   # slot 3 (its home)
    s.add(3, "c", 2)   # slot 4 (probed from 2)
    assert s.drop(1)
    # "b" must not move to slot 2 (before its home 3); "c" may
    assert s.idx.find("b", 3) == 2 and s.idx.find("c", 2) == 3
    assert reachable(s, 2) and reachable(s, 3)


def test_remove_across_wraparound():
    s = Store(8)
    s.add(1, "a", 7)   # slot 7
    s.add(2, "b", 7)   # slot 0
    s.add(3, "c", 0)   # slot 1
    s.add(4, "d", 1)   # slot 2
    assert s.drop(1)
    for e, k, h in ((2, "b", 7), (3, "c", 0), (4, "d", 1)):
        assert s.idx.find(k, h) == e
        assert reachable(s, e)
    assert s.idx.count() == 3
    assert s.drop(3)
    assert s.idx.find("b", 7) == 2 and s.idx.find("d", 1) == 4


def test_remove_missing_entry_returns_false_and_changes_nothing():
    s = Store(8)
    s.add(1, "a", 3)
    before = s.slots()
    s.homes[9] = 3
    assert s.idx.remove(9, 3) is False
    s.homes[10] = 6
    assert s.idx.remove(10, 6) is False
    assert s.slots() == before


def test_fill_to_one_empty_slot_then_empty():
    # The index needs one empty slot to stop probing; the pool sizes it at
    # >= 2x its entries, so it is at most half full.
    s = Store(8)
    for e in range(7):
        s.add(e, f"k{e}", e * 3)
    assert s.idx.count() == 7
    for e in range(7):
        assert s.idx.find(f"k{e}", e * 3) == e
    assert s.idx.find("missing", 0) == -1
    for e in range(7):
        assert s.drop(e)
        for f in range(e + 1, 7):
            assert s.idx.find(f"k{f}", f * 3) == f
    assert s.slots() == [-1] * 8


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 11), st.integers(0, 2**64 - 1)),
                max_size=60))
def test_random_inserts_and_removes_keep_everything_findable(ops):
    s = Store(16)
    live: dict = {}
    for is_insert, entry, home in ops:
        if is_insert and entry not in live and len(live) < 15:
            key = ("key", entry % 5)          # keys repeat: several entries per key
            s.add(entry, key, home % 64)      # few homes: many collisions
            live[entry] = (key, home % 64)
        elif not is_insert and entry in live:
            assert s.drop(entry)
            del live[entry]
        # the invariant after every step
        assert sorted(e for e in s.slots() if e >= 0) == sorted(live)
        for e, (key, h) in live.items():
            assert reachable(s, e)
            assert e in s.idx.find_all(key, h)
            assert s.idx.find(key, h) >= 0
    assert s.idx.count() == len(live)


@pytest.mark.parametrize("capacity", [2, 4])
def test_tiny_tables(capacity):
    s = Store(capacity)
    for e in range(capacity - 1):
        s.add(e, e, 0)
    for e in range(capacity - 1):
        assert s.idx.find(e, 0) == e
    assert s.drop(0)
    for e in range(1, capacity - 1):
        assert s.idx.find(e, 0) == e
    assert s.idx.find(0, 0) == -1


# ---------------------------------------------------------------- corruption
def test_a_full_table_is_corruption_not_a_loop():
    """A sound index always has an empty slot; with none (corruption: the
    index of a pool whose header said max_slots=1 looped forever in check())
    every probe stops after one round."""
    from shmcache.errors import CorruptPoolError
    s = Store(8)
    for e in range(8):
        s.add(e, f"k{e}", e)
    with pytest.raises(CorruptPoolError, match="no empty slot"):
        s.idx.find("absent", 3)
    with pytest.raises(CorruptPoolError):
        s.idx.find_all("absent", 3)
    with pytest.raises(CorruptPoolError):
        s.idx.insert(9, 0)
    s.homes[9] = 0
    with pytest.raises(CorruptPoolError):
        s.idx.remove(9, 0)
    assert s.idx.find("k5", 5) == 5                  # what is there is still found


def test_an_entry_out_of_range_is_corruption():
    from shmcache.errors import CorruptPoolError
    arr = np.full(8, -1, dtype=np.int32)
    seen = []
    idx = OpenIndex(memoryview(arr), lambda e: e, lambda e, key: key == e, limit=4,
                    corrupt=lambda what: seen.append(what) or CorruptPoolError(what))
    arr[2] = 1000
    with pytest.raises(CorruptPoolError, match="holds 1000"):
        idx.find(7, 2)
    assert seen and "slot 2" in seen[0]            # the pool's hook heard of it first


def test_check_of_a_pool_with_a_full_prefix_index_returns(manager):
    """check() reports, never loops: every slot of the prefix index filled."""
    import signal

    def hung(*a):
        raise AssertionError("check() did not return")
    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        manager.get_new_blocks(3)
        manager.pool.hidx[:] = 1
        problems = manager.check()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert any("no empty slot" in s or "prefix index" in s for s in problems), problems
