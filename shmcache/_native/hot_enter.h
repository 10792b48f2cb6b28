/* shmcache/_native/hot_enter.h: how a fused op of shmcache._hot takes the
 * pool mutex (hot_mutex.h) and leaves it: its turn (a ticket order among the
 * fused ops), a short spin for the mutex, the checks that the pool is clean
 * and the manager's view current, the dirty mark around its writes, and the
 * release that hands the turn on. Included by the hot_*.h headers of the
 * fused ops and by hot.cpp; no Python.
 *
 * A fused op enters (waits for its turn, spins briefly for the lock, then
 * checks that the pool is clean and the manager's view current), marks the
 * pool dirty before its first shared write (begin_update) and leaves
 * (clears the mark after its last write, unlocks, hands its turn on).
 */
#ifndef SHMCACHE_HOT_ENTER_H
#define SHMCACHE_HOT_ENTER_H

#include "hot_mutex.h"

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------- how a fused op takes the lock */

static inline void
cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* A fused op holds the lock for a microsecond or two, so when it is busy a
 * short spin usually gets it: far cheaper than the slow path's sleep in
 * futex() and wake-up. Bounded (256 tries 16 pauses apart: tens of
 * microseconds, up to about 200 where a pause is long, as on recent Xeons):
 * the holder may be a thread of this process waiting for the GIL we hold. */
static inline int
spin_lock(HotCore *h)
{
    int st = hot_trylock(h);
    for (int i = 0; st < 0 && i < 256; i++) {
        for (int k = 0; k < 16; k++)
            cpu_relax();
        st = hot_trylock(h);
    }
    return st;
}

/* --------------------------------------------------------- turns (FIFO) */

/* Polls of a turn that does not move, with the lock free, before the
 * waiter behind it skips it (about 50 µs at a pause a poll). */
#define TURN_GRACE 1024
/* Polls between two sched_yield()s of a waiter (a CPU shared with the
 * holder of the turn, or of the lock, is given up now and then). */
#define TURN_YIELD 4096
/* The longest wait for a turn (the caller then waits in the kernel for the
 * lock, hot_wait_lock): a lock word that names a thread that no longer
 * exists is noticed there, and the GIL is not held this long. */
#define TURN_MAX_NS 1000000L

static inline int
lock_word_free(const HotCore *h)
{
    return (__atomic_load_n((const uint32_t *)h->mutex, __ATOMIC_ACQUIRE) & W_TID_MASK) == 0;
}

/* Hand the turn on, if it is still turn `t` (a waiter may have skipped it). */
static inline void
pass_turn(HotCore *h, int64_t t)
{
    int64_t e = t;
    if (t >= 0)
        __atomic_compare_exchange_n(&C(h, P_C_TURN_NOW), &e, t + 1, 0, __ATOMIC_RELEASE,
                                    __ATOMIC_RELAXED);
}

/* Wait for a turn at the lock: the fused ops take the lock in the order
 * they asked for it (a ticket: C_TURN_NEXT hands out turns, C_TURN_NOW is
 * the one whose holder may take the lock). The turn, or -1 when it did not
 * come within TURN_MAX_NS (the turn is then left behind: see below).
 * h->turn_wait_ns: how long it waited.
 *
 * NOTE: why: with every waiter trying the lock at once, who gets it is
 * luck; under 16 processes a waiter could lose for hundreds of
 * microseconds, run out of spin and sleep, and every try bounced the lock's
 * cache line between the cores. In turns, the waiters poll a line that
 * changes once a hold, and each hold goes to the longest waiter.
 * The turns only order the fused ops: the robust mutex still excludes (the
 * Python path takes it without a turn), and still says when a holder died.
 * So a turn may be skipped without harm: a waiter that sees the turn
 * before its own stay for TURN_GRACE polls with the lock free skips it
 * (its holder died, gave up waiting, or is not running); one whose turn
 * was skipped takes the lock out of turn; a holder hands its turn on only
 * if it is still the current one (pass_turn). */
static inline int64_t
take_turn(HotCore *h)
{
    int64_t *now = &C(h, P_C_TURN_NOW);
    int64_t my = __atomic_fetch_add(&C(h, P_C_TURN_NEXT), 1, __ATOMIC_ACQ_REL);
    int64_t s = __atomic_load_n(now, __ATOMIC_ACQUIRE), last = s, t0;
    long polls = 0, still = 0;
    h->turn_wait_ns = 0;
    if (s - my >= 0)
        return my;
    t0 = mono_ns();
    for (;;) {
        cpu_relax();
        s = __atomic_load_n(now, __ATOMIC_ACQUIRE);
        if (s - my >= 0)
            break;
        if (s != last) {
            last = s;
            still = 0;
        }
        else if (++still >= TURN_GRACE && lock_word_free(h)) {
            __atomic_compare_exchange_n(now, &s, s + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
            last = s;
            still = 0;
        }
        if (++polls % TURN_YIELD == 0) {
            if (mono_ns() - t0 > TURN_MAX_NS) {
                h->turn_wait_ns = mono_ns() - t0;
                return -1;
            }
            sched_yield();
        }
    }
    h->turn_wait_ns = mono_ns() - t0;
    return my;
}

/* Release the lock after a fused op, and hand its turn on. */
static inline void
release(HotCore *h)
{
    int64_t t = h->turn;
    h->turn = -1;
    if (h->claimed >= 0) {      /* the table claim the op took (hot_claim.h) */
        int32_t e = -1;
        __atomic_compare_exchange_n(&TF(h, h->claimed, P_T_CLAIM), &e, 0, 0, __ATOMIC_RELEASE,
                                    __ATOMIC_RELAXED);
        h->claimed = -1;
    }
    if (h->log_holds && h->hold_start) {
        int64_t now = mono_ns();
        h->held_ns += now - h->hold_start;
        h->holds++;
        if (h->log_holds > 1)
            trace_hold(h, h->asked, h->turned, h->hold_start, now, 0);
        h->hold_start = 0;
    }
    if (pthread_mutex_unlock(h->mutex) == EPERM) {
        /* the lock word was overwritten while held (and maybe the lock taken
         * over): this hold may have overlapped another; the next holder
         * repairs */
        C(h, P_C_DIRTY) = 1;
    }
    pass_turn(h, t);
}

/* Take the lock for a fused op; 0 if the op may go on (lock held, pool
 * clean, the manager's view current); else the lock is not held: -2 when
 * its turn did not come, or the lock stayed busy through the spin (the
 * caller may wait for it and try again, see hot_wait_lock), -1 when the
 * pool is dirty or the view stale (the slow path repairs or resyncs). */
static inline int
enter(HotCore *h, long long epoch, int slot)
{
    int64_t t;
    if (h->log_holds > 1)
        h->asked = mono_ns();
    t = take_turn(h);
    if (h->log_holds > 1)
        h->turned = mono_ns();
    if (t < 0)
        return -2;
    if (spin_lock(h) < 0) {
        pass_turn(h, t);
        return -2;
    }
    h->turn = t;
    if (h->log_holds)
        h->hold_start = mono_ns();
    if (h->turn_wait_ns > C(h, P_C_LOCK_WAIT_NS))     /* the longest wait, for inspect */
        C(h, P_C_LOCK_WAIT_NS) = h->turn_wait_ns;
    if (C(h, P_C_DIRTY) || C(h, P_C_EPOCH) != epoch) {
        release(h);
        return -1;
    }
    C(h, P_C_HOLDER) = slot;
    return 0;
}

static inline void
leave(HotCore *h, int changed)
{
    C(h, P_C_OPS) += 1;
    if (changed) {
        STORE_ORDER();
        C(h, P_C_DIRTY) = 0;
    }
    /* no holder now (a dirty pool keeps the one that left it so): a lock
     * word naming a process that is not the recorded holder is not a hold
     * (slots.py's lock_owner_problem) */
    C(h, P_C_HOLDER) = -1;
    release(h);
}

/* Leave after an update that stopped part way: the pool stays dirty, and
 * the next holder repairs. */
static inline void
leave_dirty(HotCore *h)
{
    C(h, P_C_OPS) += 1;
    release(h);
}

/* Mark the pool dirty before an op's first shared write; leave() clears
 * the mark after its last.
 *
 * NOTE: only the order of the stores matters: another process reads the
 * mark only after it has taken the lock, so never while this hold runs,
 * and a holder killed mid-update leaves every store it made before the
 * kill, in program order. A release fence gives that order (on x86 it
 * only stops the compiler moving stores across it; x86 keeps stores in
 * order); a full fence (mfence) also waits for the store buffer to drain,
 * which under contention costs a cache miss per pending store, twice a
 * hold. */
static inline void
begin_update(HotCore *h)
{
    C(h, P_C_DIRTY) = 1;
    STORE_ORDER();
}

/* This thread's kernel id, asked once per thread (a system call costs a
 * good part of a fused op's whole hold, and every table op asks inside
 * its hold). A child of fork() is a new thread of a new process: the
 * handler that fork runs in the child forgets the parent's id. */
static __thread uint32_t hot_tid_known;

static void
hot_tid_forget(void)
{
    hot_tid_known = 0;
}

static void
hot_tid_register(void)
{
    pthread_atfork(NULL, NULL, hot_tid_forget);
}

static inline uint32_t
hot_tid(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    if (__builtin_expect(hot_tid_known == 0, 0)) {
        pthread_once(&once, hot_tid_register);
        hot_tid_known = (uint32_t)syscall(SYS_gettid);
    }
    return hot_tid_known;
}

/* Whether this thread holds the pool mutex (the lock word names it: glibc
 * keeps the word first in pthread_mutex_t on Linux, see owner_vanished).
 * The lock-held table ops check it: their caller took the lock. */
static inline int
held_here(const HotCore *h)
{
    uint32_t w = __atomic_load_n((uint32_t *)h->mutex, __ATOMIC_RELAXED);
    return (w & W_TID_MASK) == hot_tid();
}

#endif
