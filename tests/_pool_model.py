"""The reference model of tests/test_stateful.py: plain Python state (a
ref count per block, the free queue as a list, this manager's loose
references, the tables as lists, the prefix cache as block -> chain key),
the model's own operations, and the steps that drive the manager and the
model side by side and compare them (a mixin of the state machine there).
"""

from __future__ import annotations

from collections import Counter

import pytest

from shmcache.errors import OutOfBlocksError
from shmcache.manager.paged_cache import PagedCacheManager

BS = 4
N = 24
RIDS = [f"r{i}" for i in range(6)]
PROMPTS = [list(range(1 + 20 * i, 1 + 20 * i + 4 * BS)) for i in range(3)]
PROMPTS.append(PROMPTS[0][:2 * BS] + [99] * (2 * BS))      # shares two blocks with prompt 0
EXTRAS = [None, ("tenant", 1)]


def chain_keys(tokens, n_blocks, extra, parent=None, start=0):
    out = []
    for i in range(start, n_blocks):
        parent = (parent, tuple(tokens[i * BS:(i + 1) * BS]), extra)
        out.append(parent)
    return out


class PoolModel:
    """The model and the manager it is compared with (``self.m``)."""

    def model_init(self) -> None:
        self.m = PagedCacheManager(block_size=BS, max_blocks=N)
        self.ref = [0] * N
        self.ref[0] = 1
        self.free = list(range(1, N))
        self.tok = [0] * N
        self.loose = Counter()
        self.tables = {}                   # rid -> {"blocks": [...], "tok": int}
        self.cached = {}                   # block -> chain key
        self.hits = self.misses = self.cow = self.evictions = 0


    # ------------------------------------------------------------ model ops
    def m_pop_free(self) -> int:
        b = self.free.pop(0)
        if b in self.cached:
            del self.cached[b]
            self.evictions += 1
        self.ref[b] = 1
        self.tok[b] = 0
        return b

    def m_release(self, b: int) -> None:
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.cached:
                self.free.append(b)
            else:
                self.free.insert(0, b)

    def m_take_ref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.free.remove(b)
        self.ref[b] += 1
        self.loose[b] += 1

    def m_drop_loose(self, b: int) -> None:
        self.loose[b] -= 1
        if not self.loose[b]:
            del self.loose[b]

    def m_lookup(self, tokens, extra) -> list:
        """Per chain position, the blocks cached under its key, up to the first miss."""
        out = []
        for key in chain_keys(tokens, len(tokens) // BS, extra):
            cands = {b for b, k in self.cached.items() if k == key}
            if not cands:
                break
            out.append(cands)
        return out

    def snapshot(self):
        m = self.m
        p = m.pool
        s = m.get_stats()
        return (p.blocks["ref_count"][:N].tolist(), m.free_block_queue.ids(),
                sorted((r, t.block_ids, t.num_tokens) for r, t in m.request_tables.items()),
                sorted(m.internals.ledger.index.cached_ids()), p.blocks["token_count"][:N].tolist(),
                repr(s),
                {b: len(r) for b, r in m.internals.holder.refs.loose.as_dict().items()})

    def unchanged(self, fn, exc, *args):
        before = self.snapshot()
        with pytest.raises(exc):
            fn(*args)
        assert self.snapshot() == before

    # ------------------------------------------- steps shared by several rules
    def do_prepare_append(self, rid, n) -> bool:
        """prepare_append on both; False when it had to fail for lack of blocks."""
        t = self.tables[rid]
        blocks, tok = t["blocks"], t["tok"]
        room = len(blocks) * BS - tok
        # every existing block the new tokens land in must be private and
        # unpublished: copy the shared and the cached ones
        first, end = tok // BS, min(len(blocks), -(-(tok + n) // BS))
        cow = [i for i in range(first, end)
               if self.ref[blocks[i]] > 1 or blocks[i] in self.cached] if n > 0 else []
        new = -(-(n - room) // BS) if n > room else 0
        if len(cow) + new > len(self.free):
            self.unchanged(self.m.prepare_append, OutOfBlocksError, rid, n)
            return False
        got = [b.block_id for b in self.m.prepare_append(self.m.get_block_table(rid), n)]
        for i in cow:
            old = blocks[i]
            c = self.m_pop_free()
            self.tok[c] = self.tok[old]
            blocks[i] = c
            self.m_release(old)
            self.cow += 1
        for _ in range(new):
            blocks.append(self.m_pop_free())
        first, lastpos = tok // BS, (tok + n - 1) // BS
        want = []
        for i in range(first, lastpos + 1):
            self.tok[blocks[i]] = min(BS, tok + n - i * BS)
            want.append(blocks[i])
        t["tok"] = tok + n
        assert got == want
        return True

    def do_cache(self, rid, tokens, nc, nf, extra) -> None:
        blocks = self.tables[rid]["blocks"]
        self.m.cache_full_blocks([self.m.blocks[b] for b in blocks], tokens, nc, nf, extra)
        if nc >= nf:
            return
        if nc and blocks[nc - 1] in self.cached:
            parent = self.cached[blocks[nc - 1]]
        else:
            parent = chain_keys(tokens, nc, extra)[-1] if nc else None
        for b, key in zip(blocks[nc:nf], chain_keys(tokens, nf, extra, parent, nc)):
            if b not in self.cached:
                self.cached[b] = key
                self.tok[b] = BS

    def do_lookup(self, tokens, extra, take) -> list:
        want = self.m_lookup(tokens, extra)
        fn = self.m.acquire_computed_blocks if take else self.m.get_computed_blocks
        blocks, n = fn(tokens, extra)
        got = [b.block_id for b in blocks]
        assert len(got) == len(want) and n == len(got) * BS
        for b, cands in zip(got, want):
            assert b in cands
        self.hits += len(got)
        self.misses += len(got) < len(tokens) // BS
        if take:
            for b in got:
                self.m_take_ref(b)
        return got
