"""Invariant check and repair of a pool's shared state.

``check`` verifies every invariant stated in ``freelist``, ``refs``,
``index`` and ``layout``. ``repair`` rebuilds all derived state (ref counts,
the free list, both indexes, the chunk free list, the ends of every list's
chain) from the truth: the ids in the lists of live tables and attached
slots (as many as their lengths say), and each block's cached flag and hash.
It runs when a lock holder died mid-update, so it assumes nothing about the
derived state.
"""

from __future__ import annotations

import numpy as np

from ..shm import layout as L
from ..errors import CorruptPoolError
from ..shm.index import OpenIndex
from ..shm import claims
from . import reserve
from .reclaim import orphan_tables

CI, CW = L.CHUNK_IDS, L.CHUNK_WORDS


def _chunks_for(n: int) -> int:
    return -(-n // CI)


def _walk_chunks(p, head: int, k: int, seen: set):
    """(up to ``k`` chunks of the chain at ``head``, whether all ``k`` were
    good): a link out of range or to a chunk already claimed (by this list or
    another) ends the walk; the chunks walked are claimed in ``seen``."""
    nch = p.layout.num_chunks
    kw = p.kw
    out: list = []
    c = head
    for _ in range(k):
        if not 0 <= c < nch or c in seen:
            return out, False
        seen.add(c)
        out.append(c)
        c = kw[c * CW]
    return out, True


def _table_list(p, t: int, seen: set):
    """(chunks, ids, ok) of table ``t``: its ids in order up to the first
    bad link or id naming no block (``ok`` False then), and the chunks
    holding them."""
    nch, n = p.layout.num_chunks, p.layout.max_blocks
    count = p.t_len[t]
    if not 0 <= count <= nch * CI:
        return [], np.zeros(0, np.int32), False
    chunks, whole = _walk_chunks(p, p.t_head[t], _chunks_for(count), seen)
    ids = p.kmat[chunks, 1:].reshape(-1)[:count] if chunks else np.zeros(0, np.int32)
    bad = np.flatnonzero((ids < 1) | (ids >= n))
    m = int(bad[0]) if bad.size else len(ids)
    keep = _chunks_for(m)
    for c in chunks[keep:]:
        seen.discard(c)
    return chunks[:keep], ids[:m].copy(), whole and m == count


def _slot_list(p, s: int, seen: set):
    """(chunks, ids, ok) of slot ``s``'s loose list: every good id of the
    chunks reachable (the first chunk holds the newest, partly filled)."""
    nch, n = p.layout.num_chunks, p.layout.max_blocks
    count = p.s_count[s]
    if not 0 <= count <= nch * CI:
        return [], np.zeros(0, np.int32), False
    chunks, whole = _walk_chunks(p, p.s_head[s], _chunks_for(count), seen)
    if not chunks:
        return [], np.zeros(0, np.int32), whole
    f = (count - 1) % CI + 1
    ids = np.concatenate([p.kmat[chunks[0], 1:1 + f], p.kmat[chunks[1:], 1:].reshape(-1)])
    good = (ids >= 1) & (ids < n)
    return chunks, ids[good].copy(), whole and bool(good.all())


def reachable_lists(p, problems=None):
    """The lists of attached slots and live tables: [(kind, index, chunks,
    ids, ok)], each chunk claimed by the first list that reaches it."""
    seen: set = set()
    owners = []
    for s in np.flatnonzero(p.slots["state"] == 1).tolist():
        chunks, ids, ok = _slot_list(p, s, seen)
        if not ok and problems is not None:
            problems.append(f"slot {s}: loose list of {p.s_count[s]} ids is cut short, shares a "
                            "chunk, links out of range or names no block")
        owners.append(("slot", s, chunks, ids, ok))
    for t in np.flatnonzero(p.tables["state"] == 1).tolist():
        chunks, ids, ok = _table_list(p, t, seen)
        if not ok and problems is not None:
            problems.append(f"table {t}: list of {p.t_len[t]} ids is cut short, shares a chunk, "
                            "links out of range or names no block")
        owners.append(("table", t, chunks, ids, ok))
    return owners


def expected_ref_counts(p, owners) -> np.ndarray:
    n = p.layout.max_blocks
    lists = [o[3] for o in owners if len(o[3])]
    ids = np.concatenate(lists) if lists else np.zeros(0, np.int32)
    ref = np.bincount(ids, minlength=n).astype(np.int64)
    ref[0] += 1
    return ref


def _free_chunk_list(p, limit: int):
    """(chunks of the free chunk list, whether it was sound): bounded."""
    nch = p.layout.num_chunks
    kw = p.kw
    out: list = []
    seen, c = set(), p.counters.free_ref
    for _ in range(limit + 1):
        if c == -1:
            return out, True
        if not 0 <= c < nch or c in seen:
            return out, False
        seen.add(c)
        out.append(c)
        c = kw[c * CW]
    return out, False


def block_hash_bytes(p, b: int) -> bytes:
    """The 16-byte chain hash stored in block ``b``'s record."""
    off = p.layout.blocks_off + b * L.BLOCK_DTYPE.itemsize + L.BLOCK_HASH_OFF
    return bytes(p.raw[off:off + L.HASH_BYTES])


def _plain(index) -> OpenIndex:
    # The same index, reporting corruption by a plain exception: check()
    # changes nothing (the pool's own indexes repair before raising).
    return OpenIndex(index.slots, index.home_of, index.matches, index.limit, name=index.name)


def check(p) -> list:
    """Every inconsistency between the pool's lists and its derived state
    (lock held; changes nothing). ``p`` is a mapped pool (``pool.Pool``)."""
    lay = p.layout
    n = lay.max_blocks
    out: list = []
    b = p.blocks
    flags = b["flags"][:n]
    refc = b["ref_count"][:n].astype(np.int64)
    # null block
    if not flags[0] & L.FLAG_NULL or refc[0] != 1:
        out.append(f"null block 0: flags={flags[0]} ref_count={refc[0]} (want NULL, 1)")
    if (flags[1:] & L.FLAG_NULL).any():
        out.append("a block other than 0 is flagged null")
    # references
    owners = reachable_lists(p, out)
    want = expected_ref_counts(p, owners)
    bad = np.flatnonzero(want != refc)
    for i in bad[:20].tolist():
        out.append(f"block {i}: ref_count {refc[i]} but {want[i]} references are held")
    kw, nch = p.kw, lay.num_chunks
    used = 0
    for kind, i, chunks, ids, ok in owners:
        used += len(chunks)
        if chunks and kw[chunks[-1] * CW] != -1:
            out.append(f"{kind} {i}: its chain goes on past its last chunk {chunks[-1]}")
        if kind == "table":
            head, tail = p.t_head[i], p.t_tail[i]
            if (tail, head) != ((chunks[-1], chunks[0]) if chunks else (-1, -1)) and ok:
                out.append(f"table {i}: head {head} / tail {tail} are not its first / last chunk")
            if p.t_tok[i] > p.t_len[i] * lay.block_size:
                out.append(f"table {i}: num_tokens {p.t_tok[i]} do not fit its {p.t_len[i]} "
                           f"blocks of {lay.block_size}")
        elif ok and not chunks and p.s_head[i] != -1:
            out.append(f"slot {i}: no loose references but its list head is {p.s_head[i]}")
    free, ok = _free_chunk_list(p, nch)
    if not ok:
        out.append("the free chunk list is cyclic or out of range")
    if any(kw[c * CW + 1] != -1 for c in free):
        out.append("a chunk on the free list holds a block id")
    claimed = set(c for o in owners for c in o[2])
    if claimed & set(free):
        out.append("a chunk is both in a list and on the free list")
    if len(free) + used != nch:
        out.append(f"chunks: {len(free)} free + {used} in lists != {nch}")
    k = p.counters
    if k.free_refs != len(free):
        out.append(f"free chunk counter {k.free_refs} != {len(free)}")
    # free list
    nxt, prv = p.b_next, p.b_prev
    seen: list = []
    cur, prev = nxt[p.HEAD], p.HEAD
    while cur != p.TAIL:
        if cur < 0 or cur >= n or len(seen) > n:
            out.append(f"free list broken after block {prev} (next={cur})")
            break
        if prv[cur] != prev:
            out.append(f"free list: block {cur}.prev is {prv[cur]}, want {prev}")
        seen.append(cur)
        prev, cur = cur, nxt[cur]
    else:
        if prv[p.TAIL] != prev:
            out.append(f"free list: tail sentinel's prev is {prv[p.TAIL]}, want {prev}")
    if len(seen) != k.num_free:
        out.append(f"free list holds {len(seen)} blocks, num_free_blocks says {k.num_free}")
    in_list = np.zeros(n, bool)
    in_list[np.asarray(seen, dtype=np.int64)] = True
    if len(set(seen)) != len(seen):
        out.append("a block appears twice in the free list")
    free_not_listed = np.flatnonzero((refc == 0) & ~in_list)
    if free_not_listed.size:
        out.append(f"blocks {free_not_listed[:10].tolist()} have ref_count 0 but are not in the free list")
    listed_held = np.flatnonzero((refc != 0) & in_list)
    if listed_held.size:
        out.append(f"blocks {listed_held[:10].tolist()} are in the free list but referenced")
    marked = reserve.valid_marks(p, owners)
    off_list = np.flatnonzero(~in_list & ~marked & ((b["prev"][:n] != -1) | (b["next"][:n] != -1)))
    if off_list.size:
        out.append(f"blocks {off_list[:10].tolist()} are out of the free list but keep links "
                   "(or a mark of a slot that does not hold them loose)")
    # (a slot's ``reserved`` is not checked: its owner moves it without the
    # lock, so only the marks are the truth)
    # prefix index
    cached = set(np.flatnonzero(flags & L.FLAG_CACHED).tolist())
    entries = [int(e) for e in p.hidx if e >= 0]
    if len(entries) != len(set(entries)):
        out.append("a block appears twice in the prefix index")
    if set(entries) != cached:
        out.append(f"prefix index has {len(set(entries))} blocks, {len(cached)} are flagged cached "
                   f"(differ: {sorted(set(entries) ^ cached)[:10]})")
    hindex, tindex = _plain(p.hindex), _plain(p.tindex)
    for e in entries:
        if 0 <= e < n:
            try:
                found = hindex.find(block_hash_bytes(p, e), p.hhome(e))
            except CorruptPoolError as ex:
                out.append(f"block {e}: {ex}")
                break
            if found < 0:
                out.append(f"block {e} is in the prefix index but not found from its hash")
    if not lay.enable_caching and cached:
        out.append("caching is disabled but blocks are cached")
    if 0 in cached:
        out.append("the null block is cached")
    # table index
    live = set(np.flatnonzero(p.tables["state"] == 1).tolist())
    tent = [int(e) for e in p.tidx if e >= 0]
    if set(tent) != live or len(tent) != len(set(tent)):
        out.append(f"table index has {sorted(tent)[:10]}, live tables are {sorted(live)[:10]}")
    for t in live:
        rid = bytes(p.tables["request_id"][t])
        try:
            found = tindex.find(rid, int(p.tables["rid_hash"][t]))
        except CorruptPoolError as ex:
            out.append(f"table {t}: {ex}")
            break
        if found != t:
            out.append(f"table {t} ({rid!r}) is not found from its request id")
        if p.t_tok[t] < 0:
            out.append(f"table {t}: num_tokens {p.t_tok[t]} is negative")
    if k.num_tables != len(live):
        out.append(f"table counter {k.num_tables} != {len(live)} live tables")
    for t in orphan_tables(p):
        out.append(f"table {t} ({bytes(p.tables['request_id'][t]).rstrip(bytes(1))!r}) is owned "
                   f"by slot {int(p.tables['owner'][t])}, which is not attached: nobody would "
                   f"release its {int(p.t_len[t])} blocks (a corrupted owner; reclaim releases it)")
    out += claims.stale_claims(p)
    if k.pure != claims.count_pure(p):
        out.append(f"pure-process counter {k.pure} != {claims.count_pure(p)} attached")
    return out


def repair(p) -> None:
    """Rebuild every derived structure from the lists (lock held)."""
    # no append without the lock while the lists are rebuilt
    claims.claim_every_table(p)
    lay = p.layout
    n = lay.max_blocks
    b = p.blocks
    kw, km, nch = p.kw, p.kmat, lay.num_chunks
    # Lists keep what is readable: a table its ids up to the first bad one
    # (its length cut there), a loose list its good ids (rewritten below
    # when any was lost). A chunk reached by two lists stays with the first.
    owners = reachable_lists(p)
    rewrite = []
    for kind, i, chunks, ids, ok in owners:
        if kind == "slot":
            if not ok:
                p.s_head[i], p.s_count[i] = -1, 0
                rewrite.append((i, ids))
                chunks.clear()
            elif chunks:
                kw[chunks[-1] * CW] = -1
            else:
                p.s_head[i] = -1
        else:
            p.t_len[i] = len(ids)
            if chunks:
                kw[chunks[-1] * CW] = -1
                p.t_head[i], p.t_tail[i] = chunks[0], chunks[-1]
            else:
                p.t_head[i] = p.t_tail[i] = -1
            p.t_tok[i] = min(max(p.t_tok[i], 0), len(ids) * lay.block_size)
    # chunks: every one no list holds is free
    held = np.zeros(nch, bool)
    for o in owners:
        held[np.asarray(o[2], dtype=np.int64)] = True
    free = np.flatnonzero(~held).astype(np.int32)
    km[free, 1] = -1
    if free.size:
        km[free[:-1], 0] = free[1:]
        km[free[-1], 0] = -1
    p.counters.free_ref = int(free[0]) if free.size else -1
    p.counters.free_refs = int(free.size)
    # loose lists that lost ids: written afresh (they need no more chunks
    # than they had)
    fr = list(free[::-1])
    for s, ids in rewrite:
        head, cnt = -1, 0
        for x in ids.tolist():
            if cnt % CI == 0:
                c = int(fr.pop())
                kw[c * CW] = head
                head = c
            kw[head * CW + 1 + cnt % CI] = x
            cnt += 1
        p.s_head[s], p.s_count[s] = head, cnt
    if rewrite:
        fr.reverse()
        if fr:
            km[fr[:-1], 0] = fr[1:]
            km[fr[-1], 0] = -1
        p.counters.free_ref = int(fr[0]) if fr else -1
        p.counters.free_refs = len(fr)
    # ref counts and flags
    refc = expected_ref_counts(p, owners)
    b["ref_count"][:n] = refc.astype(np.int32)
    b["flags"][0] = L.FLAG_NULL
    b["flags"][1:n] &= ~np.uint16(L.FLAG_NULL)
    b["flags"][0] &= ~np.uint16(L.FLAG_CACHED)
    if not lay.enable_caching:
        b["flags"][:n] &= ~np.uint16(L.FLAG_CACHED)
    # free list: uncached first, then cached in LRU order
    flags = b["flags"][:n]
    is_free = refc == 0
    is_free[0] = False
    ids = np.flatnonzero(is_free)
    cached = (flags[ids] & L.FLAG_CACHED) != 0
    order = np.concatenate([ids[~cached],
                            ids[cached][np.argsort(b["last_access"][ids[cached]], kind="stable")]])
    # (the marks of reserves stay: their owners change them without the lock,
    # each by compare-and-swap from one mark to the other, so only a wrong
    # one is written)
    keep = reserve.valid_marks(p, owners)
    clear = np.flatnonzero(~keep & (b["prev"][:n] != -1))
    b["prev"][clear] = -1
    b["next"][:n] = -1
    pv = b["prev"][:n].astype(np.int64)
    in_res = (pv <= -2) & (pv > -2 - lay.max_slots)
    p.slots["reserved"][:] = np.bincount(-2 - pv[in_res], minlength=lay.max_slots)[:lay.max_slots]
    chain = np.concatenate([[p.HEAD], order, [p.TAIL]]).astype(np.int32)
    b["next"][chain[:-1]] = chain[1:]
    b["prev"][chain[1:]] = chain[:-1]
    b["prev"][p.HEAD] = -1
    b["next"][p.TAIL] = -1
    p.counters.num_free = int(order.size)
    # indexes
    p.hidx[:] = -1
    for e in np.flatnonzero(flags & L.FLAG_CACHED).tolist():
        p.hindex.insert(e, p.hhome(e))
    p.tidx[:] = -1
    live = np.flatnonzero(p.tables["state"] == 1).tolist()
    for t in live:
        p.tindex.insert(t, int(p.tables["rid_hash"][t]))
    k = p.counters
    k.num_tables = len(live)
    k.pure = claims.count_pure(p)
    k.count_recovery()
    k.bump_epoch()


def scan_stats(p) -> dict:
    """The statistics of ``get_stats``/``shmcache inspect`` from the state
    (``total_tokens_cached`` is the seed's running count, ``C_TOKENS``)."""
    lay = p.layout
    n = lay.max_blocks
    b = p.blocks
    refc = b["ref_count"][:n]
    alloc = refc > 0
    live_t = p.tables["state"] == 1
    live_s = p.slots["state"] == 1
    # (read once: reserves change without the lock, and both figures count them)
    reserved = reserve.reserved_total(p)
    return {
        "total_blocks": n,
        "allocated_blocks": int(alloc.sum()) - reserved,
        "free_blocks": int(p.counters.num_free) + reserved,
        "shared_blocks": int((refc[1:] > 1).sum()),
        "total_tokens_cached": int(p.counters.tokens),
        "tokens_held": int(b["token_count"][1:n][alloc[1:]].sum(dtype=np.int64)),
        "cached_blocks": int(((b["flags"][:n] & L.FLAG_CACHED) != 0).sum()),
        "refs_held": int(p.tables["length"][live_t].sum(dtype=np.int64)
                         + p.slots["loose_count"][live_s].sum(dtype=np.int64)),
        "max_refs": lay.max_refs,
        "block_tables": int(live_t.sum()),
        "max_tables": lay.max_tables,
        "attached": int(live_s.sum()),
        "max_slots": lay.max_slots,
    }
