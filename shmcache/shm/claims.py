"""Table claims: who may write a block table now (layout.py's TABLE_DTYPE
``claim``; the C side, and why it is enough, is
``shmcache/_native/hot_claim.h``).

A table's owner appends into the table's private last block without the
pool lock, and any process reads a table's block ids without it, holding
the table's claim (``slot + 1``) for the few hundred nanoseconds it takes. Every hold that writes a table takes the claim first
(0 -> -1) and gives it back before the hold ends, so the two never write
the same table at once. Callers hold the pool lock.

NOTE: a pure process (no C accelerator) has no compare-and-swap: it takes a
claim with a plain store once it reads 0. That is safe because no append
runs without the lock while a pure process is attached (``C_PURE``; the
C side reads it after taking its claim, and backs off without a write).
"""

from __future__ import annotations

import logging
import time

import numpy as np


logger = logging.getLogger("shmcache.manager.paged_cache")

# How long a claim may name one live slot, unchanged, before it is taken as
# stuck (a corrupted word, or a claimer stopped for that long inside the few
# instructions of an append): an append holds its claim for well under a
# microsecond of running time. As the pool mutex's DEAD_OWNER_SLICES.
CLAIM_STUCK_S = 1.0


def _try(p, t: int) -> int:
    """One attempt at table ``t``'s claim: 0 taken, -1 this hold's already,
    else the holder (slot + 1) that kept it."""
    r = p.ops.claim_table(t)
    if r is not None:
        return r
    v = int(p.t_claim[t])
    if v == 0:
        p.t_claim[t] = -1
    return v


def claim(p, t: int) -> None:
    """Take table ``t``'s claim for this hold (given back by ``release``
    when the hold ends). Waits for an owner's append in progress; takes
    over the claim of a slot that is dead, and one that stayed unchanged for
    ``CLAIM_STUCK_S`` (a corrupted word, or a claimer stopped that long):
    the wait is bounded, as the mutex's is."""
    lock = p.lock
    if t in lock.claimed:
        return
    first, deadline, polls = None, 0.0, 0
    while True:
        v = _try(p, t)
        if v in (0, -1):
            break
        s = v - 1
        if not 0 <= s < p.layout.max_slots or p.slots["state"][s] != 1 or not p.slot_ops.slot_alive(s):
            # its holder is gone mid-append: the table's fields are each
            # valid (hot_claim.h), so the claim is simply taken over
            p.t_claim[t] = -1
            break
        now = time.monotonic()
        if v != first:
            first, deadline = v, now + CLAIM_STUCK_S
        elif now >= deadline:
            logger.warning("pool %r: table %d's claim named live slot %d unchanged for %.1f s "
                           "(a corrupted word, or its process stopped mid-append); taken over",
                           p.name, t, s, CLAIM_STUCK_S)
            p.t_claim[t] = -1
            break
        polls += 1
        # a live owner that is not running: let it finish (yield, then sleep)
        time.sleep(0 if polls < 64 else 0.001)
    lock.claimed.append(t)


def stuck_claims(claim_words, live_slot, wait: float = CLAIM_STUCK_S) -> list:
    """(check, fsck) Tables whose claim names a live slot and stays
    unchanged for ``wait`` seconds: [(table, slot)]. ``claim_words`` is the
    live claim column (re-read while waiting), ``live_slot(s)`` whether slot
    s is attached and alive. Returns at once when no such claim is seen
    (the usual case: an append holds its claim for nanoseconds)."""
    cl = np.asarray(claim_words)

    def suspects():
        out = {}
        for t in np.flatnonzero(cl > 0).tolist():
            v = int(cl[t])
            if live_slot(v - 1):
                out[t] = v
        return out

    seen = suspects()
    deadline = time.monotonic() + wait
    while seen and time.monotonic() < deadline:
        time.sleep(0.01)
        seen = {t: v for t, v in seen.items() if int(cl[t]) == v}
    return [(t, v - 1) for t, v in sorted(seen.items())]


def release(p) -> None:
    """Give back every claim this hold took (PoolLock's exit)."""
    lock = p.lock
    unclaim = p.ops.unclaim_table
    for t in lock.claimed:
        unclaim(t)
    lock.claimed.clear()


def claim_every_table(p) -> None:
    """Recovery's start: claims of -1 not this hold's were a dead lock
    holder's (given back); then every live table's claim is taken, so that
    no append runs while the lists are rebuilt (each wait bounded:
    ``claim``)."""
    mine = set(p.lock.claimed)
    for t in np.flatnonzero(np.asarray(p.t_claim) == -1).tolist():
        if t not in mine:
            p.t_claim[t] = 0
    # (and every record with a claim: a free record's claim is a probe in
    # progress, or a stuck, dead or corrupted one, taken over and given back)
    for t in np.flatnonzero((np.asarray(p.t_state) == 1) | (np.asarray(p.t_claim) != 0)).tolist():
        claim(p, t)


def stale_claims(p) -> list:
    """(check) Problems: a claim of -1 no hold has, or of a slot that is not
    attached. (A copy taken without the lock, fsck's, has no hold: its -1
    claims are a hold's in progress when it was copied, and not reported.)"""
    out = []
    lock = getattr(p, "lock", None)
    if lock is None:
        mine = set(np.flatnonzero(np.asarray(p.t_claim) == -1).tolist())
    else:
        mine = set(lock.claimed)
    cl = np.asarray(p.t_claim)
    for t in np.flatnonzero(cl != 0).tolist():
        v = int(cl[t])
        if v == -1 and t not in mine:
            out.append(f"table {t}: claimed by a lock holder that is gone")
        elif v != -1 and not (1 <= v <= p.layout.max_slots and p.slots["state"][v - 1] == 1):
            out.append(f"table {t}: claimed by slot {v - 1}, which is not attached")
    if lock is not None:
        # a live pool (the lock held): a claim that names a live slot and
        # does not move is stuck (a copy's claims cannot move: PoolView.fsck
        # watches the live ones)
        out += stuck_claim_lines(p, stuck_claims(
            p.tables["claim"], lambda s: 0 <= s < p.layout.max_slots
            and p.slots["state"][s] == 1 and p.slot_ops.slot_alive(s)))
    return out


def stuck_claim_lines(p, stuck) -> list:
    return [f"table {t}: claimed by live slot {s} (pid {int(p.slots['pid'][s])}) unchanged for "
            f"{CLAIM_STUCK_S:.0f} s: a stuck or corrupted claim (the next lock holder that "
            "needs the table takes it over; fsck --repair clears it)" for t, s in stuck]


def count_pure(p) -> int:
    """Attached slots without the C accelerator (recovery recounts C_PURE)."""
    return int(((p.slots["state"] == 1) & (p.slots["pure"] == 1)).sum())


def attach_pure(p, slot: int, pure: bool) -> None:
    """Record whether ``slot`` (being claimed) runs without the accelerator."""
    p.slots["pure"][slot] = int(pure)
    if pure:
        p.counters.pure_attached()


def detach_pure(p, slot: int) -> None:
    """``slot`` goes (closed, or dead): it no longer counts in C_PURE."""
    if p.slots["pure"][slot]:
        p.slots["pure"][slot] = 0
        p.counters.pure_detached()
