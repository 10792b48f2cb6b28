/* shmcache/_native/hot_mutex.h: the pool mutex, and how shmcache._hot's fused
 * ops take it. Included by hot.cpp and the hot_*.h headers of the fused ops;
 * it includes hot_params.h (HotCore, the offsets of the mutex and the
 * counters), so that it also compiles on its own. No Python: the mutex
 * calls return errno values, which the binding raises as OSError.
 *
 * The pool lock is a process-shared *robust* pthread mutex that lives in the
 * pool header (layout.MUTEX_OFF): locking it costs no system call when it is
 * free, and when its holder dies the kernel hands it to the next locker with
 * EOWNERDEAD (we make it consistent at once and report it, so that the caller
 * looks at the pool's dirty mark and repairs if the holder died mid-update).
 *
 * A fused op enters (spin briefly for the lock, then check that the pool is
 * clean and the manager's view current), marks the pool dirty before its
 * first shared write (begin_update) and leaves (clears the mark after its
 * last write, unlocks).
 */
#ifndef SHMCACHE_HOT_MUTEX_H
#define SHMCACHE_HOT_MUTEX_H

#include "hot_params.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <sched.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#define FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
/* Orders the stores before it before the stores after it: what the dirty
 * mark needs (see begin_update). */
#define STORE_ORDER() __atomic_thread_fence(__ATOMIC_RELEASE)

/* ------------------------------------------------------------- the mutex */

/* Initialise the robust mutex (the pool's creator only): 0, or an errno. */
static inline int
hot_init_mutex(HotCore *h)
{
    pthread_mutexattr_t a;
    int e;
    if ((e = pthread_mutexattr_init(&a)) ||
        (e = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED)) ||
        (e = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST)) ||
        (e = pthread_mutexattr_settype(&a, PTHREAD_MUTEX_ERRORCHECK)) ||
        (e = pthread_mutex_init(h->mutex, &a)))
        return e;
    pthread_mutexattr_destroy(&a);
    return 0;
}

/* Taken from a holder that died: make the mutex usable again and mark the
 * pool dirty, so that whoever holds it next repairs (and reclaims the dead
 * holder's references) whether or not it died mid-update. */
static inline void
owner_died(HotCore *h)
{
    pthread_mutex_consistent(h->mutex);
    C(h, P_C_DIRTY) = 1;
    FENCE();
}

/* 0: locked; 1: locked, the previous holder died holding it; -1: busy.
 * Never waits (the binding's trylock(), and the fused ops' spin). */
static inline int
hot_trylock(HotCore *h)
{
    int e = pthread_mutex_trylock(h->mutex);
    if (e == 0)
        return 0;
    if (e == EOWNERDEAD) {
        owner_died(h);
        return 1;
    }
    return -1;
}

/* How long one futex sleep on the pool lock may last before the waiter
 * looks at the lock word again (see lock_bounded). */
#define LOCK_SLICE_NS 10000000L     /* 10 ms */

/* pthread_mutex_lock, but no sleep lasts longer than LOCK_SLICE_NS.
 *
 * NOTE: a plain lock can sleep forever on a free lock. glibc's unlock wakes
 * one waiter only when the word carries FUTEX_WAITERS; if the woken waiter
 * is SIGKILLed before it runs while a third process took the free lock by
 * CAS (the word then has no FUTEX_WAITERS bit, and the kernel's exit
 * handling wakes nobody because the word names a live owner), or an
 * unlocker dies between clearing the word and the wake, the remaining
 * waiters are never woken. A timed lock in a loop re-reads the word every
 * slice, so a live waiter notices a free lock within LOCK_SLICE_NS.
 * `slices` counts the slices that ran out (a test hook: how the waiter
 * got the lock). */
/* Slices a lock word may name the same owner before we ask whether that
 * owner still exists (see owner_vanished). */
#define DEAD_OWNER_SLICES 100       /* 1 s */
#define W_WAITERS 0x80000000u
#define W_OWNER_DIED 0x40000000u
#define W_TID_MASK 0x3fffffffu

/* The lock word names a thread that no longer exists, and nothing told the
 * kernel (a corrupted or planted word, or a holder that died without a
 * robust list entry): mark the owner dead as the kernel does at a thread's
 * exit, so that the next lock attempt returns EOWNERDEAD and repairs.
 *
 * NOTE: only after the same word stayed for DEAD_OWNER_SLICES: a live holder
 * changes it or releases it long before that; and the word is changed by
 * compare-and-swap, so a holder that released it meanwhile is never touched.
 * The thread id is in our pid namespace: a pool shared across pid
 * namespaces is not supported. glibc keeps the lock word first in
 * pthread_mutex_t on Linux. */
static inline void
owner_vanished(pthread_mutex_t *m, uint32_t w)
{
    uint32_t tid = w & W_TID_MASK;
    if (!tid || (w & W_OWNER_DIED))
        return;
    if (kill((pid_t)tid, 0) == 0 || errno != ESRCH)
        return;
    __atomic_compare_exchange_n((uint32_t *)m, &w, (w & W_WAITERS) | W_OWNER_DIED, 0,
                                __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

static inline int
lock_bounded(pthread_mutex_t *m, long *slices)
{
    uint32_t last = 0;
    int same = 0;
    for (;;) {
        struct timespec ts;
        int e;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += LOCK_SLICE_NS;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec += 1;
            ts.tv_nsec -= 1000000000L;
        }
        e = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &ts);
        if (e != ETIMEDOUT)
            return e;
        if (slices)
            (*slices)++;
        uint32_t w = __atomic_load_n((uint32_t *)m, __ATOMIC_ACQUIRE);
        same = (w == last) ? same + 1 : 0;
        last = w;
        if (same >= DEAD_OWNER_SLICES) {
            owner_vanished(m, w);
            same = 0;
        }
    }
}

/* Wait for the lock (the binding releases the GIL around it): 0, locked;
 * EOWNERDEAD, locked after its holder died (made consistent, the pool marked
 * dirty: owner_died); else the errno of the failure (not locked). `slices`
 * counts the wait's slices that ran out (lock_bounded). */
static inline int
hot_lock(HotCore *h, long *slices)
{
    int e = lock_bounded(h->mutex, slices);
    if (e == EOWNERDEAD)
        owner_died(h);
    return e;
}

/* For a fused op that found the lock busy (HOT_BUSY): sleep in the kernel
 * until the lock is ours, and hand it straight back, so that the op can be
 * tried again in C. 0 when it went so (also after a holder that died: the
 * pool is then marked dirty, and the op's retry sends it to the slow path,
 * which repairs); else an errno (EDEADLK: this thread holds the lock), and
 * the op takes the slow path.
 *
 * NOTE: why not fall to the slow path at once: the slow path runs the op in
 * Python under the lock, tens of times longer than the C op, so under heavy
 * contention one fallback makes the others' spins fail too and they fall
 * back in turn (a convoy: on 16 processes the batched mix lost most of its
 * throughput so). Why hand the lock back rather than run the op holding it:
 * the op needs the GIL, and waiting for the GIL while holding the pool lock
 * would stall every other process behind this one's threads. */
static inline int
hot_wait_lock(HotCore *h, long *slices)
{
    int e = hot_lock(h, slices);
    if (e == 0 || e == EOWNERDEAD)
        return pthread_mutex_unlock(h->mutex);
    return e;
}

/* Release the lock: 0, or an errno (not held by this thread). */
static inline int
hot_unlock(HotCore *h)
{
    return pthread_mutex_unlock(h->mutex);
}

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
 * futex() and wake-up. Bounded (a few tens of microseconds): the holder may
 * be a thread of this process waiting for the GIL we hold. */
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

static inline int64_t
mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

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
    pthread_mutex_unlock(h->mutex);
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
    int64_t t = take_turn(h);
    if (t < 0)
        return -2;
    if (spin_lock(h) < 0) {
        pass_turn(h, t);
        return -2;
    }
    h->turn = t;
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

/* Whether this thread holds the pool mutex (the lock word names it: glibc
 * keeps the word first in pthread_mutex_t on Linux, see owner_vanished).
 * The lock-held table ops check it: their caller took the lock. */
static inline int
held_here(const HotCore *h)
{
    uint32_t w = __atomic_load_n((uint32_t *)h->mutex, __ATOMIC_RELAXED);
    return (w & W_TID_MASK) == (uint32_t)syscall(SYS_gettid);
}

#endif
