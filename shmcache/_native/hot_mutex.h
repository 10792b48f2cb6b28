/* shmcache/_native/hot_mutex.h: the pool mutex. Included by hot_enter.h (how
 * shmcache._hot's fused ops take it) and by hot.cpp; it includes
 * hot_params.h (HotCore, the offsets of the mutex and the counters), so that
 * it also compiles on its own. No Python: the mutex calls return errno
 * values, which the binding raises as OSError.
 *
 * The pool lock is a process-shared *robust* pthread mutex that lives in the
 * pool header (layout.MUTEX_OFF): locking it costs no system call when it is
 * free, and when its holder dies the kernel hands it to the next locker with
 * EOWNERDEAD (we make it consistent at once and report it, so that the caller
 * looks at the pool's dirty mark and repairs if the holder died mid-update).
 *
 * How a fused op takes it, marks the pool dirty around its writes and
 * leaves it is hot_enter.h.
 */
#ifndef SHMCACHE_HOT_MUTEX_H
#define SHMCACHE_HOT_MUTEX_H

#include "hot_params.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#define FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
/* Orders the stores before it before the stores after it: what the dirty
 * mark needs (see begin_update). */
#define STORE_ORDER() __atomic_thread_fence(__ATOMIC_RELEASE)

/* ------------------------------------------------------------- the mutex */

static inline int64_t
mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Trace one hold (log_holds 2): (asked, turn, locked, released, kind),
 * CLOCK_MONOTONIC ns: when the op asked for the lock, when its turn came
 * (hot_enter.h's take_turn; = asked where there is none), when it had the
 * lock and when it let it go. kind 0: a fused op's hold; 1: an empty hold
 * of hot_wait_lock's; 2: a Python hold (the binding's trace_hold). */
#define TRACE_WORDS 5
static inline void
trace_hold(HotCore *h, int64_t asked, int64_t turn, int64_t locked, int64_t released,
           int64_t kind)
{
    if (h->trace && h->trace_n + TRACE_WORDS <= h->trace_cap) {
        int64_t *r = h->trace + h->trace_n;
        r[0] = asked;
        r[1] = turn;
        r[2] = locked;
        r[3] = released;
        r[4] = kind;
        h->trace_n += TRACE_WORDS;
    }
}

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

/* lock_bounded's answer when the lock word named one thread that still
 * exists for DEAD_OWNER_SLICES and the caller asked to hear it (give_up):
 * the lock is not held; the caller decides (a zombie, or a process that is
 * not the pool's recorded holder: slots.py's lock_owner_problem) and may
 * mark the owner dead (hot_mark_owner_dead) before it waits again. */
#define LOCK_OWNER_STUCK (-2)

/* Mark the owner of lock word w dead, as the kernel does at a thread's exit
 * (compare-and-swap: a word that changed meanwhile is left alone), so that
 * the next lock attempt returns EOWNERDEAD and repairs: 1 if marked. */
static inline int
hot_mark_owner_dead(pthread_mutex_t *m, uint32_t w)
{
    if (!(w & W_TID_MASK) || (w & W_OWNER_DIED))
        return 0;
    return __atomic_compare_exchange_n((uint32_t *)m, &w, (w & W_WAITERS) | W_OWNER_DIED, 0,
                                       __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}

static inline int
lock_bounded(pthread_mutex_t *m, long *slices, int give_up)
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
            if (give_up && __atomic_load_n((uint32_t *)m, __ATOMIC_ACQUIRE) == w)
                return LOCK_OWNER_STUCK;
        }
    }
}

/* Wait for the lock (the binding releases the GIL around it): 0, locked;
 * EOWNERDEAD, locked after its holder died (made consistent, the pool marked
 * dirty: owner_died); with give_up, LOCK_OWNER_STUCK when the word named
 * one live thread for DEAD_OWNER_SLICES (not locked); else the errno of the
 * failure (not locked). `slices` counts the wait's slices that ran out
 * (lock_bounded). */
static inline int
hot_lock(HotCore *h, long *slices, int give_up)
{
    int e = lock_bounded(h->mutex, slices, give_up);
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
    int64_t t0 = mono_ns(), w;
    /* (give_up: a word naming a live thread that long is for the slow path
     * to judge, PoolLock) */
    int e = hot_lock(h, slices, 1);
    if (e == 0 || e == EOWNERDEAD) {
        int64_t locked = mono_ns();
        w = locked - t0;
        if (w > C(h, P_C_LOCK_WAIT_NS))     /* the longest wait, for inspect */
            C(h, P_C_LOCK_WAIT_NS) = w;
        e = pthread_mutex_unlock(h->mutex);
        if (h->log_holds > 1)
            trace_hold(h, t0, t0, locked, mono_ns(), 1);
        return e;
    }
    return e;
}

/* Release the lock: 0, or an errno (not held by this thread). */
static inline int
hot_unlock(HotCore *h)
{
    return pthread_mutex_unlock(h->mutex);
}

#endif
