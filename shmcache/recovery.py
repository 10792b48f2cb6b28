"""Invariant check and repair of a pool's shared state.

``check`` verifies every invariant stated in ``freelist``, ``refs``,
``index`` and ``layout``. ``repair`` rebuilds all derived state (ref counts,
the free list, both indexes, list lengths, the record free list) from the
truth: the reference records reachable from live tables and attached slots,
and each block's cached flag and hash. It runs when a lock holder died
mid-update, so it assumes nothing about the derived state.
"""

from __future__ import annotations

import numpy as np

from . import layout as L
from .errors import CorruptPoolError
from .index import OpenIndex


def _walk(p, head: int, limit: int, blocks: bool = False):
    """(records of the list at ``head`` up to the first bad link, whether all
    were good): a link outside [0, limit), a cycle, or (with ``blocks``) a
    record naming no block in [1, max_blocks) ends the walk."""
    out, r, seen = [], head, set()
    n = p.layout.max_blocks
    while r >= 0:
        if r >= limit or r in seen or (blocks and not 0 < p.r_block[r] < n):
            return out, False
        seen.add(r)
        out.append(r)
        r = p.r_next[r]
    return out, True


def reachable_records(p, problems=None):
    """Records of live slots' loose lists and live tables: (records, per-owner
    lists), each list cut before its first bad link or record (``_walk``)."""
    limit = p.layout.max_refs
    owners = []
    for s in np.flatnonzero(p.slots["state"] == 1).tolist():
        recs, ok = _walk(p, p.s_head[s], limit, True)
        if not ok and problems is not None:
            problems.append(f"slot {s}: loose list is cyclic, out of range or names no block")
        owners.append(("slot", s, recs))
    for t in np.flatnonzero(p.tables["state"] == 1).tolist():
        recs, ok = _walk(p, p.t_head[t], limit, True)
        if not ok and problems is not None:
            problems.append(f"table {t}: list is cyclic, out of range or names no block")
        owners.append(("table", t, recs))
    allrecs = [r for _, _, recs in owners for r in recs]
    return allrecs, owners


def expected_ref_counts(p, records) -> np.ndarray:
    n = p.layout.max_blocks
    ids = p.refs["block_id"][np.asarray(records, dtype=np.int64)] if records else np.zeros(0, np.int32)
    ids = ids[(ids >= 0) & (ids < n)]
    ref = np.bincount(ids, minlength=n).astype(np.int64)
    ref[0] += 1
    return ref


def _plain(index) -> OpenIndex:
    # The same index, reporting corruption by a plain exception: check()
    # changes nothing (the pool's own indexes repair before raising).
    return OpenIndex(index.slots, index.home_of, index.matches, index.limit, name=index.name)


def check(mgr) -> list:
    p = mgr._p
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
    recs, owners = reachable_records(p, out)
    if len(set(recs)) != len(recs):
        out.append("a reference record is linked into two lists")
    want = expected_ref_counts(p, recs)
    bad = np.flatnonzero(want != refc)
    for i in bad[:20].tolist():
        out.append(f"block {i}: ref_count {refc[i]} but {want[i]} references are held")
    used = np.flatnonzero(p.refs["block_id"] >= 0)
    leaked = np.setdiff1d(used, np.asarray(recs, dtype=np.int64))
    if leaked.size:
        out.append(f"{leaked.size} reference records are in use but held by nobody")
    free_recs, ok = _walk(p, p.c[L.C_FREE_REF], lay.max_refs)
    if not ok:
        out.append("the free reference-record list is cyclic or out of range")
    if len(free_recs) + len(recs) != lay.max_refs:
        out.append(f"reference records: {len(free_recs)} free + {len(recs)} held != {lay.max_refs}")
    if p.c[L.C_FREE_REFS] != len(free_recs):
        out.append(f"free reference-record counter {p.c[L.C_FREE_REFS]} != {len(free_recs)}")
    for kind, i, rl in owners:
        if kind == "slot" and p.s_count[i] != len(rl):
            out.append(f"slot {i}: loose_count {p.s_count[i]} != {len(rl)} records")
        if kind == "table":
            if p.t_len[i] != len(rl):
                out.append(f"table {i}: length {p.t_len[i]} != {len(rl)} records")
            if (rl[-1] if rl else -1) != p.t_tail[i]:
                out.append(f"table {i}: tail {p.t_tail[i]} is not its last record")
    # free list
    nxt, prv = p.b_next, p.b_prev
    seen, cur, prev = [], nxt[p.HEAD], p.HEAD
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
    if len(seen) != p.c[L.C_NUM_FREE]:
        out.append(f"free list holds {len(seen)} blocks, num_free_blocks says {p.c[L.C_NUM_FREE]}")
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
    off_list = np.flatnonzero(~in_list & ((b["prev"][:n] != -1) | (b["next"][:n] != -1)))
    if off_list.size:
        out.append(f"blocks {off_list[:10].tolist()} are out of the free list but keep links")
    # prefix index
    cached = set(np.flatnonzero(flags & L.FLAG_CACHED).tolist())
    entries = [int(e) for e in p.hidx if e >= 0]
    if len(entries) != len(set(entries)):
        out.append("a block appears twice in the prefix index")
    if set(entries) != cached:
        out.append(f"prefix index has {len(set(entries))} blocks, {len(cached)} are flagged cached "
                   f"(differ: {sorted(set(entries) ^ cached)[:10]})")
    hindex, tindex = _plain(mgr._hindex), _plain(mgr._tindex)
    for e in entries:
        if 0 <= e < n:
            try:
                found = hindex.find(mgr._block_hash(e), mgr._hhome(e))
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
    if p.c[L.C_NUM_TABLES] != len(live):
        out.append(f"table counter {p.c[L.C_NUM_TABLES]} != {len(live)} live tables")
    return out


def repair(mgr) -> None:
    """Rebuild every derived structure from the records (lock held)."""
    p = mgr._p
    lay = p.layout
    n = lay.max_blocks
    b = p.blocks
    recs, owners = reachable_records(p)
    # A record in two lists cannot be told apart; keep its first owner.
    # Lists are cut before a bad link or a record naming no block (_walk).
    seen = set()
    for kind, i, rl in owners:
        keep = []
        for r in rl:
            if r in seen:
                break
            seen.add(r)
            keep.append(r)
        if keep:
            p.r_next[keep[-1]] = -1
        if kind == "slot":
            p.s_head[i] = keep[0] if keep else -1
            p.s_count[i] = len(keep)
        else:
            p.t_head[i] = keep[0] if keep else -1
            p.t_tail[i] = keep[-1] if keep else -1
            p.t_len[i] = len(keep)
            if p.t_tok[i] < 0:
                p.t_tok[i] = 0
    recs = list(seen)
    # records: free every one nobody holds
    held = np.zeros(lay.max_refs, bool)
    held[np.asarray(recs, dtype=np.int64)] = True
    free = np.flatnonzero(~held).astype(np.int32)
    p.refs["block_id"][free] = -1
    if free.size:
        p.refs["next"][free[:-1]] = free[1:]
        p.refs["next"][free[-1]] = -1
    p.c[L.C_FREE_REF] = int(free[0]) if free.size else -1
    p.c[L.C_FREE_REFS] = int(free.size)
    # ref counts and flags
    refc = expected_ref_counts(p, recs)
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
    b["prev"][:n] = -1
    b["next"][:n] = -1
    chain = np.concatenate([[p.HEAD], order, [p.TAIL]]).astype(np.int32)
    b["next"][chain[:-1]] = chain[1:]
    b["prev"][chain[1:]] = chain[:-1]
    b["prev"][p.HEAD] = -1
    b["next"][p.TAIL] = -1
    p.c[L.C_NUM_FREE] = int(order.size)
    # indexes
    p.hidx[:] = -1
    for e in np.flatnonzero(flags & L.FLAG_CACHED).tolist():
        mgr._hindex.insert(e, mgr._hhome(e))
    p.tidx[:] = -1
    live = np.flatnonzero(p.tables["state"] == 1).tolist()
    for t in live:
        mgr._tindex.insert(t, int(p.tables["rid_hash"][t]))
    p.c[L.C_NUM_TABLES] = len(live)
    p.c[L.C_RECOVERIES] += 1
    p.c[L.C_EPOCH] += 1


def scan_stats(p) -> dict:
    n = p.layout.max_blocks
    b = p.blocks
    refc = b["ref_count"][:n]
    alloc = refc > 0
    return {
        "total_blocks": n,
        "allocated_blocks": int(alloc.sum()),
        "free_blocks": int(p.c[L.C_NUM_FREE]),
        "shared_blocks": int((refc[1:] > 1).sum()),
        "total_tokens_cached": int(b["token_count"][1:n][alloc[1:]].sum(dtype=np.int64)),
        "cached_blocks": int(((b["flags"][:n] & L.FLAG_CACHED) != 0).sum()),
    }
