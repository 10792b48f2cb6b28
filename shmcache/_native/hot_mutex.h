/* shmcache/_native/hot_mutex.h: the pool mutex, and how shmcache._hot's fused
 * ops take it. Included by hot.c only; it includes Python.h itself, first,
 * so that it also compiles on its own.
 *
 * Hot is the Python object: a writable buffer over the pool's mapping and
 * the offsets (a tuple of ints, in the order of the P_ enum) of the mutex,
 * the counters and every field the fused ops touch (see layout.py).
 *
 * The pool lock is a process-shared *robust* pthread mutex that lives in the
 * pool header (layout.MUTEX_OFF): locking it costs no system call when it is
 * free, and when its holder dies the kernel hands it to the next locker with
 * EOWNERDEAD (we make it consistent at once and return 1, so that the caller
 * looks at the pool's dirty mark and repairs if the holder died mid-update).
 *
 * A fused op enters (spin briefly for the lock, then check that the pool is
 * clean and the manager's view current), marks the pool dirty before its
 * first shared write (begin_update) and leaves (clears the mark after its
 * last write, unlocks).
 */
#ifndef SHMCACHE_HOT_MUTEX_H
#define SHMCACHE_HOT_MUTEX_H

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>     /* before any system header, as Python requires */

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <signal.h>
#include <sys/types.h>

/* The parameters Hot() takes, in this order (a tuple of ints). */
enum {
    P_MUTEX_OFF, P_COUNTERS_OFF,
    P_BLOCKS_OFF, P_BLOCK_SIZE, P_B_REF, P_B_PREV, P_B_NEXT, P_B_FLAGS, P_B_TOK, P_B_LAST,
    P_REFS_OFF, P_REF_SIZE, P_R_BLOCK, P_R_NEXT,
    P_SLOTS_OFF, P_SLOT_SIZE, P_S_HEAD, P_S_COUNT,
    P_MAX_BLOCKS, P_MAX_SLOTS, P_FLAG_CACHED,
    P_C_DIRTY, P_C_NUM_FREE, P_C_FREE_REF, P_C_FREE_REFS, P_C_OPS, P_C_EPOCH, P_C_HOLDER,
    P_TABLES_OFF, P_TABLE_SIZE, P_T_STATE, P_T_HEAD, P_T_TAIL, P_T_LEN, P_T_TOK,
    P_MAX_TABLES, P_C_NUM_TABLES, P_HASH_OFF, P_HASH_CAP, P_B_HASH,
    P_TINDEX_OFF, P_TINDEX_CAP, P_T_RID, P_RID_BYTES, P_T_RHASH, P_T_OWNER,
    P_COUNT
};

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    char *base;
    pthread_mutex_t *mutex;
    int64_t *c;
    Py_ssize_t p[P_COUNT];
    double created_at;
} Hot;

#define FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#define BF(h, b, f, T) (*(T *)((h)->base + (h)->p[P_BLOCKS_OFF] + (int64_t)(b) * (h)->p[P_BLOCK_SIZE] + (h)->p[f]))
#define REF(h, b) BF(h, b, P_B_REF, int32_t)
#define PREV(h, b) BF(h, b, P_B_PREV, int32_t)
#define NEXT(h, b) BF(h, b, P_B_NEXT, int32_t)
#define FLAGS(h, b) BF(h, b, P_B_FLAGS, uint16_t)
#define TOK(h, b) BF(h, b, P_B_TOK, uint16_t)
#define LAST(h, b) BF(h, b, P_B_LAST, float)
#define RF(h, r, f) (*(int32_t *)((h)->base + (h)->p[P_REFS_OFF] + (int64_t)(r) * (h)->p[P_REF_SIZE] + (h)->p[f]))
#define RBLOCK(h, r) RF(h, r, P_R_BLOCK)
#define RNEXT(h, r) RF(h, r, P_R_NEXT)
#define TF(h, t, f) (*(int32_t *)((h)->base + (h)->p[P_TABLES_OFF] + (int64_t)(t) * (h)->p[P_TABLE_SIZE] + (h)->p[f]))
#define SF(h, s, f) (*(int32_t *)((h)->base + (h)->p[P_SLOTS_OFF] + (int64_t)(s) * (h)->p[P_SLOT_SIZE] + (h)->p[f]))
#define C(h, i) ((h)->c[(h)->p[i]])

static int
hot_ready(Hot *h)
{
    if (!h->has_view) {
        PyErr_SetString(PyExc_ValueError, "pool mapping already released");
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------- the mutex */

static PyObject *
Hot_init_mutex(Hot *self, PyObject *unused)
{
    pthread_mutexattr_t a;
    int e;
    if (!hot_ready(self))
        return NULL;
    if ((e = pthread_mutexattr_init(&a)) ||
        (e = pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED)) ||
        (e = pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST)) ||
        (e = pthread_mutexattr_settype(&a, PTHREAD_MUTEX_ERRORCHECK)) ||
        (e = pthread_mutex_init(self->mutex, &a))) {
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    pthread_mutexattr_destroy(&a);
    Py_RETURN_NONE;
}

/* Taken from a holder that died: make the mutex usable again and mark the
 * pool dirty, so that whoever holds it next repairs (and reclaims the dead
 * holder's references) whether or not it died mid-update. */
static void
owner_died(Hot *h)
{
    pthread_mutex_consistent(h->mutex);
    C(h, P_C_DIRTY) = 1;
    FENCE();
}

/* 0: locked; 1: locked, the previous holder died holding it; -1: busy. */
static int
try_lock(Hot *h)
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

static PyObject *
Hot_trylock(Hot *self, PyObject *unused)
{
    if (!hot_ready(self))
        return NULL;
    return PyLong_FromLong(try_lock(self));
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
static void
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

static int
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

static long lock_slices_expired;   /* this process's count, for tests */

static PyObject *
Hot_lock(Hot *self, PyObject *unused)
{
    int e;
    if (!hot_ready(self))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    e = lock_bounded(self->mutex, &lock_slices_expired);
    if (e == EOWNERDEAD)
        owner_died(self);
    Py_END_ALLOW_THREADS
    if (e == 0 || e == EOWNERDEAD)
        return PyLong_FromLong(e == EOWNERDEAD);
    errno = e;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *
Hot_lock_slices(Hot *self, PyObject *unused)
{
    return PyLong_FromLong(lock_slices_expired);
}

static PyObject *
Hot_unlock(Hot *self, PyObject *unused)
{
    int e;
    if (!hot_ready(self))
        return NULL;
    if ((e = pthread_mutex_unlock(self->mutex))) {
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
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
static int
spin_lock(Hot *h)
{
    int st = try_lock(h);
    for (int i = 0; st < 0 && i < 256; i++) {
        for (int k = 0; k < 16; k++)
            cpu_relax();
        st = try_lock(h);
    }
    return st;
}

/* Take the lock for a fused op; 0 if the op may go on (lock held, pool
 * clean, the manager's view current), -1 (lock not held) otherwise. */
static int
enter(Hot *h, long long epoch, int slot)
{
    if (spin_lock(h) < 0)
        return -1;
    if (C(h, P_C_DIRTY) || C(h, P_C_EPOCH) != epoch) {
        pthread_mutex_unlock(h->mutex);
        return -1;
    }
    C(h, P_C_HOLDER) = slot;
    return 0;
}

static void
leave(Hot *h, int changed)
{
    C(h, P_C_OPS) += 1;
    if (changed) {
        FENCE();
        C(h, P_C_DIRTY) = 0;
    }
    pthread_mutex_unlock(h->mutex);
}

static void
begin_update(Hot *h)
{
    C(h, P_C_DIRTY) = 1;
    FENCE();
}

#endif
