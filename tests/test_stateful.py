"""Property-based stateful test: a manager against a small reference model.

The model is plain Python: a ref count per block, the free queue as a list
(front = next to be reused), this manager's loose references, the tables as
lists, and the prefix cache as block -> chain key (a chain key is
``(parent_key, chunk_tokens, extra_keys)``, so it names a block's whole
prefix, as the chain hash does). After every step the manager must agree
with the model on every ref count, the free queue in order, the tables, the
cache, the statistics, and ``check()`` must be empty. Bad inputs must raise
and leave both unchanged. (The model and the steps that drive both:
tests/_pool_model.py.)
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shmcache.errors import OutOfBlocksError

from _mutex import python_only
from _pool_model import BS, EXTRAS, N, PROMPTS, RIDS, PoolModel


class PoolMachine(PoolModel, RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.model_init()

    def teardown(self):
        self.m.close()

    # ---------------------------------------------------------------- rules
    @rule()
    def allocate(self):
        b = self.m.allocate_block()
        if not self.free:
            assert b is None
            return
        want = self.m_pop_free()
        assert b.block_id == want and b.ref_count == 1
        self.loose[want] += 1

    @rule(k=st.integers(0, 8))
    def get_new_blocks(self, k):
        if k > len(self.free):
            self.unchanged(self.m.get_new_blocks, OutOfBlocksError, k)
            return
        got = [b.block_id for b in self.m.get_new_blocks(k)]
        want = [self.m_pop_free() for _ in range(k)]
        assert got == want
        for b in want:
            self.loose[b] += 1

    @precondition(lambda self: self.loose)
    @rule(data=st.data())
    def free_loose(self, data):
        b = data.draw(st.sampled_from(sorted(self.loose)))
        became_free = self.m.free_block(b)
        self.m_drop_loose(b)
        self.m_release(b)
        assert became_free == (self.ref[b] == 0)

    @precondition(lambda self: self.loose)
    @rule(data=st.data())
    def free_batch(self, data):
        held = sorted(self.loose.elements())
        batch = data.draw(st.lists(st.sampled_from(range(len(held))), min_size=1,
                                   max_size=len(held), unique=True))
        batch = [held[i] for i in batch]
        self.m.free_block_batch(batch)
        for b in batch:
            self.m_drop_loose(b)
            self.m_release(b)

    @rule(ids=st.lists(st.integers(0, N - 1), min_size=1, max_size=3))
    def touch(self, ids):
        self.m.touch(ids)
        for b in ids:
            if b != 0:
                self.m_take_ref(b)

    @rule(rid=st.sampled_from(RIDS))
    def create_table(self, rid):
        if rid in self.tables:
            self.unchanged(self.m.create_block_table, ValueError, rid)
            return
        t = self.m.create_block_table(rid)
        assert t.request_id == rid and t.block_ids == [] and t.num_tokens == 0
        self.tables[rid] = {"blocks": [], "tok": 0}

    @precondition(lambda self: self.loose and self.tables)
    @rule(data=st.data(), n=st.integers(0, BS))
    def add_to_table(self, data, n):
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        b = data.draw(st.sampled_from(sorted(self.loose)))
        self.m.add_block_to_table(self.m.get_block_table(rid), self.m.blocks[b], n)
        self.m_drop_loose(b)
        self.tables[rid]["blocks"].append(b)
        self.tables[rid]["tok"] += n
        self.tok[b] = n

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), dst=st.sampled_from(RIDS))
    def fork_table(self, data, dst):
        src = data.draw(st.sampled_from(sorted(self.tables)))
        if dst in self.tables:
            self.unchanged(self.m.fork_block_table, ValueError, src, dst)
            return
        t = self.m.fork_block_table(self.m.get_block_table(src), dst)
        blocks = list(self.tables[src]["blocks"])
        for b in blocks:
            self.ref[b] += 1
        self.tables[dst] = {"blocks": blocks, "tok": self.tables[src]["tok"]}
        assert t.block_ids == blocks

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def delete_table(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        self.m.delete_block_table(rid)
        for b in reversed(self.tables.pop(rid)["blocks"]):
            self.m_release(b)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), n=st.integers(0, 9))
    def prepare_append(self, data, n):
        self.do_prepare_append(data.draw(st.sampled_from(sorted(self.tables))), n)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), p=st.integers(0, len(PROMPTS) - 1), e=st.integers(0, 1))
    def cache_full_blocks(self, data, p, e):
        rid = data.draw(st.sampled_from(sorted(self.tables)))
        tokens = PROMPTS[p]
        nf = data.draw(st.integers(0, min(len(self.tables[rid]["blocks"]), len(tokens) // BS)))
        nc = data.draw(st.integers(0, nf))
        self.do_cache(rid, tokens, nc, nf, EXTRAS[e])

    @rule(p=st.integers(0, len(PROMPTS) - 1), e=st.integers(0, 1),
          length=st.integers(0, 4 * BS + 2), take=st.booleans())
    def lookup(self, p, e, length, take):
        self.do_lookup((PROMPTS[p] + [7, 7])[:length], EXTRAS[e], take)

    # Compound rule: the seed's request flow, so that random runs reach cache
    # hits, shared blocks, copy-on-write and eviction often.
    @precondition(lambda self: len(self.tables) < len(RIDS))
    @rule(p=st.integers(0, len(PROMPTS) - 1), e=st.integers(0, 1), k=st.integers(1, 4),
          partial=st.integers(0, BS - 1))
    def request(self, p, e, k, partial):
        """Acquire the cached prefix, table it, append the rest, publish the full blocks."""
        rid = min(r for r in RIDS if r not in self.tables)
        tokens = PROMPTS[p][:k * BS] + [5] * partial
        extra = EXTRAS[e]
        got = self.do_lookup(tokens, extra, True)
        t = self.m.create_block_table(rid)
        self.tables[rid] = {"blocks": [], "tok": 0}
        for b in got:
            self.m.add_block_to_table(t, self.m.blocks[b], BS)
            self.m_drop_loose(b)
            self.tables[rid]["blocks"].append(b)
            self.tables[rid]["tok"] += BS
            self.tok[b] = BS
        if self.do_prepare_append(rid, len(tokens) - len(got) * BS):
            self.do_cache(rid, tokens, len(got), len(tokens) // BS, extra)

    @rule(k=st.integers(0, N))
    def evict_lru_blocks(self, k):
        n = self.m.evict_lru_blocks(k)
        dropped = [b for b in self.free[:k] if b in self.cached]
        for b in dropped:
            del self.cached[b]
        self.evictions += len(dropped)
        assert n == min(k, len(self.free))       # the seed's count: blocks looked at

    # ------------------------------------------------------- bad input
    @rule(data=st.data())
    def bad_input(self, data):
        m = self.m
        unknown = [r for r in RIDS + ["zz"] if r not in self.tables]
        not_loose = [b for b in range(1, N) if self.ref[b] > 0 and b not in self.loose]
        cases = [
            (m.free_block, ValueError, -1),
            (m.free_block, ValueError, N),
            (m.free_block, TypeError, "3"),
            (m.free_block, TypeError, 1.0),
            (m.free_block_batch, ValueError, [0]),
            (m.free_block_batch, ValueError, [N + 3]),
            (m.get_new_blocks, ValueError, -1),
            (m.get_new_blocks, ValueError, "2"),
            (m.evict_lru_blocks, ValueError, -2),
            (m.touch, ValueError, [N]),
            (m.create_block_table, TypeError, ""),
            (m.create_block_table, TypeError, 5),
            (m.delete_block_table, KeyError, unknown[0]),
            (m.fork_block_table, KeyError, unknown[0], "new-one"),
            (m.prepare_append, KeyError, unknown[0], 1),
            (m.acquire_computed_blocks, ValueError, [1, 2, -3, 4]),
            (m.acquire_computed_blocks, TypeError, [1, 2, "x", 4]),
            (m.cache_full_blocks, ValueError, [], PROMPTS[0], -1, 1),
        ]
        if self.loose:
            b = min(self.loose)
            # more frees than references held: nothing is freed
            cases.append((m.free_block_batch, ValueError, [b] * (self.loose[b] + 1)))
        if not_loose:
            b = not_loose[0]          # held, but only inside a table: a double free
            cases.append((m.free_block, ValueError, b))
            cases.append((m.free_block_batch, ValueError, [b]))
        if self.tables:
            rid = min(self.tables)
            cases += [
                (m.create_block_table, ValueError, rid),
                (m.prepare_append, ValueError, rid, -1),
                (m.add_block_to_table, KeyError, unknown[0], m.blocks[1], 1),
                (m.cache_full_blocks, ValueError, [m.blocks[b] for b in self.tables[rid]["blocks"]],
                 PROMPTS[0], 0, len(self.tables[rid]["blocks"]) + 1),
            ]
            if len(self.tables) > 1:
                cases.append((m.fork_block_table, ValueError, rid, max(self.tables)))
            cases.append((m.add_block_to_table, ValueError, rid, m.blocks[0], 1))   # null
            if self.loose:
                cases.append((m.add_block_to_table, ValueError, rid, m.blocks[min(self.loose)],
                              BS + 1))
        free_now = [b for b in range(1, N) if self.ref[b] == 0]
        if free_now:
            # a free block: the seed's "unknown block" return value, nothing changes
            before = self.snapshot()
            assert m.free_block(free_now[0]) is False
            assert self.snapshot() == before
            if self.tables:
                cases.append((m.cache_full_blocks, ValueError, [m.blocks[free_now[0]]],
                              PROMPTS[0], 0, 1))
        before = self.snapshot()
        assert m.free_block(0) is False                 # the null block is never freed
        assert self.snapshot() == before
        fn, exc, *args = data.draw(st.sampled_from(cases))
        self.unchanged(fn, exc, *args)

    # ------------------------------------------------------- invariants
    @invariant()
    def agrees_with_model(self):
        m, p = self.m, self.m.pool
        assert p.blocks["ref_count"][:N].tolist() == self.ref
        assert m.free_block_queue.ids() == self.free
        assert m.free_blocks == len(self.free)
        assert sorted(m.request_tables) == sorted(self.tables)
        assert len(m.request_tables) == len(self.tables)
        for rid, t in self.tables.items():
            mt = m.get_block_table(rid)
            assert mt.block_ids == t["blocks"] and mt.num_tokens == t["tok"], rid
            assert len(mt) == len(t["blocks"])
        assert sorted(m.internals.ledger.index.cached_ids()) == sorted(self.cached)
        assert {b: len(r) for b, r in m.internals.holder.refs.loose.as_dict().items()} == dict(self.loose)
        alloc = [b for b in range(N) if self.ref[b] > 0]
        assert [p.blocks["token_count"][b] for b in alloc] == [self.tok[b] for b in alloc]
        s = m.get_stats()
        assert s.total_blocks == N
        assert s.allocated_blocks == len(alloc)
        assert s.free_blocks == len(self.free)
        assert s.shared_blocks == sum(1 for b in range(1, N) if self.ref[b] > 1)
        assert s.tokens_held == sum(self.tok[b] for b in alloc if b)
        assert s.refs_held == sum(self.loose.values()) + sum(
            len(t["blocks"]) for t in self.tables.values())
        assert (s.cache_hits, s.cache_misses, s.cow_copies, s.evictions) == \
            (self.hits, self.misses, self.cow, self.evictions)
        assert m.stats.free_blocks == len(self.free)
        hold = m.holdings()
        assert len(hold) == 1 and hold[0]["loose_blocks"] == sum(self.loose.values())
        assert hold[0]["table_blocks"] == sum(len(t["blocks"]) for t in self.tables.values())

    @invariant()
    def consistent(self):
        assert self.m.check() == []


class ReferenceOpsMachine(PoolMachine):
    """The same rules with the pool's Python reference operations
    (``hot_ops.ReferenceOps``) where the C accelerator runs in PoolMachine
    (with ``SHMCACHE_PURE=1`` both run the reference)."""

    def __init__(self):
        super().__init__()
        python_only(self.m)


_SETTINGS = settings(
    max_examples=50, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
PoolMachine.TestCase.settings = _SETTINGS
ReferenceOpsMachine.TestCase.settings = _SETTINGS
TestPoolAgainstModel = pytest.mark.timeout(300)(PoolMachine.TestCase)
TestReferenceOpsAgainstModel = pytest.mark.timeout(300)(ReferenceOpsMachine.TestCase)
