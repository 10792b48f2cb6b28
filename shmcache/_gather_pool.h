/* shmcache/_gather_pool.h: the helper threads of large gathers, kept from one
 * call to the next. Included by _gather.h (after GatherJob and gather_run);
 * each module that includes it has its own pool.
 *
 * gather_pool_run(job, total, threads) runs tasks [0, total) of `job` on the
 * calling thread and on up to threads-1 helpers, and returns 1 once every
 * task has run; it returns 0 (nothing run) when another thread of this
 * process is using the pool, no helper can be started, or the pool is
 * backing off (below): the caller then runs the job alone.
 *
 * Invariant: every task runs exactly once, and no helper touches a job after
 * gather_pool_run has returned. NOTE: why it holds: tasks are claimed in
 * grains from one counter (`next`), so two threads never claim the same
 * task; a helper joins a job only under the mutex and only while it is
 * `open`; the caller closes it under the same mutex once it finds no task
 * left to claim, then waits until `inside` (helpers that joined) is zero.
 * `next` and the job are only reset by the next call, under the mutex, with
 * no helper inside (only one caller at a time gets past `busy`, and it
 * clears `busy` only once `inside` is zero), so a late helper cannot claim
 * from a half-set job.
 *
 * NOTE: why helpers are kept, and spin before they sleep: on the development
 * VM (2 vCPUs) an 8 MiB memcpy split over two threads took 101-131 us with a
 * helper still spinning, 175-586 us with one woken by a condition variable
 * (795-1254 us after 2 ms idle, when it sleeps), 173-783 us with a thread
 * started per call, and 224-322 us on one thread (tools/handoff.c, five
 * runs). So a helper spins (GATHER_SPIN_NS, about what one large gather
 * takes) after each job, as OpenMP's and OpenBLAS's threads do, then sleeps
 * on the condition variable. While it spins it yields every 64 pauses, so
 * that a busy machine's other threads (the caller's among them) get the CPU:
 * without that, with a CPU-bound process on the second vCPU, the spinning
 * helper took time from the caller itself.
 * The claims are what make a late helper harmless: the caller starts on the
 * work at once, and a helper that arrives after the last grain was claimed
 * costs the caller nothing but the mutex.
 *
 * NOTE: why the caller backs off: when the other CPUs are busy, a helper
 * that has claimed a grain can be preempted in the middle of it, and the
 * caller must wait for it (the helper writes into the caller's buffer). With
 * a CPU-bound process on the second vCPU, 512-block float16 reads went to
 * 0.27-0.35x of np.copyto on two threads against 0.90x on one. So when the
 * caller's final wait exceeds GATHER_WAIT_NS and a quarter of the job, it
 * runs the next `backoff` jobs alone: GATHER_BACKOFF_MIN at first, twice the
 * last count after each further bad job (up to GATHER_BACKOFF_MAX), while a
 * good job halves it. The first job after a run alone, and the first after
 * starting a helper, are not judged: the helper has usually gone to sleep
 * by then (or is new), and is slow to start here (above); judging that job
 * kept the pool backing off for good. Jobs that are always far apart find
 * the helper asleep every time and are judged as they come: if a woken
 * helper costs more than it saves, running alone is right for them.
 * gather_pool_stats counts what happened.
 *
 * After fork() the child has no helpers: pthread_atfork holds the mutex
 * across the fork and resets the pool in the child. Helpers block the
 * asynchronous signals (they are the caller's to handle), not the ones a
 * fault raises (SIGBUS if the shared file shrinks under a read, say), so
 * that those still kill the process with a report.
 */
#ifndef SHMCACHE_GATHER_POOL_H
#define SHMCACHE_GATHER_POOL_H

#include <sched.h>
#include <signal.h>
#include <time.h>

#define GATHER_GRAIN_BYTES (128 << 10)
#define GATHER_SPIN_NS 300000
#define GATHER_WAIT_NS 50000      /* a final wait this long, and over 1/4 of the job: bad */
#define GATHER_BACKOFF_MIN 8      /* jobs run alone after the first bad one */
#define GATHER_BACKOFF_MAX 1024

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    GatherJob job;
    int64_t total, grain, next;   /* next: the first unclaimed task */
    uint64_t seq;                 /* bumped when a job is posted */
    int open, want, inside, sleeping, helpers, busy, atfork, grow_failed;
    int64_t skip, backoff;        /* jobs still to run alone; the last such count */
    int fresh;                    /* the next job is not judged (see the back-off NOTE) */
    int64_t shared, skipped, backoffs;      /* counts, for gather_pool_stats */
    int64_t test_delay_ns;                  /* tests only: helpers sleep this before each grain */
} GatherPool;

static GatherPool gather_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void
gather_pause(void)
{
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("isb");
#endif
}

static int64_t
gather_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* A helper is sharing the job for all its grains; the caller, for those it
 * claims once a helper has joined (see shared_stream in _gather.h). */
static void
gather_take(GatherPool *p, int helper)
{
    GatherJob g = p->job;
    for (;;) {
        int64_t t = __atomic_fetch_add(&p->next, p->grain, __ATOMIC_RELAXED);
        if (t >= p->total)
            return;
        g.begin = t, g.end = t + p->grain < p->total ? t + p->grain : p->total;
        int64_t delay = __atomic_load_n(&p->test_delay_ns, __ATOMIC_RELAXED);
        if (helper && delay) {
            struct timespec d = {0, (long)delay};
            nanosleep(&d, NULL);
        }
        g.stream = helper || __atomic_load_n(&p->inside, __ATOMIC_RELAXED) ? p->job.shared_stream
                                                                          : p->job.stream;
        gather_run(&g);
    }
}

static uint64_t
gather_await(GatherPool *p, uint64_t seen)
{
    int64_t until = gather_now_ns() + GATHER_SPIN_NS;
    for (unsigned k = 1;; k++) {
        uint64_t s = __atomic_load_n(&p->seq, __ATOMIC_ACQUIRE);
        if (s != seen)
            return s;
        gather_pause();
        if (k % 64 == 0) {
            if (gather_now_ns() > until)
                break;
            sched_yield();   /* a spinning helper gives way to any other runnable thread */
        }
    }
    pthread_mutex_lock(&p->mu);
    p->sleeping++;
    while (__atomic_load_n(&p->seq, __ATOMIC_RELAXED) == seen)
        pthread_cond_wait(&p->wake, &p->mu);
    p->sleeping--;
    uint64_t s = p->seq;
    pthread_mutex_unlock(&p->mu);
    return s;
}

static void *
gather_helper(void *arg)
{
    GatherPool *p = (GatherPool *)arg;
    uint64_t seen = 0;
    for (;;) {
        seen = gather_await(p, seen);
        pthread_mutex_lock(&p->mu);
        int join = p->open && p->seq == seen &&
                   __atomic_load_n(&p->inside, __ATOMIC_RELAXED) < p->want;
        if (join)
            __atomic_fetch_add(&p->inside, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&p->mu);
        if (join) {
            gather_take(p, 1);
            __atomic_fetch_sub(&p->inside, 1, __ATOMIC_RELEASE);
        }
    }
    return NULL;
}

static void
gather_pool_prefork(void)
{
    pthread_mutex_lock(&gather_pool.mu);
}

static void
gather_pool_postfork_parent(void)
{
    pthread_mutex_unlock(&gather_pool.mu);
}

static void
gather_pool_postfork_child(void)
{
    GatherPool *p = &gather_pool;
    pthread_mutex_unlock(&p->mu);      /* this thread locked it before the fork */
    pthread_cond_init(&p->wake, NULL); /* its waiters were the parent's helpers */
    p->open = p->inside = p->sleeping = p->helpers = p->busy = p->grow_failed = 0;
    p->skip = p->backoff = 0;
    p->fresh = 1;
}

/* Under the mutex. Once pthread_create has failed it is not tried again. */
static void
gather_pool_grow(GatherPool *p, int helpers)
{
    sigset_t sigs, old;
    if (p->helpers >= helpers || p->grow_failed)
        return;
    sigfillset(&sigs);
    sigdelset(&sigs, SIGBUS), sigdelset(&sigs, SIGSEGV);
    sigdelset(&sigs, SIGFPE), sigdelset(&sigs, SIGILL);
    pthread_sigmask(SIG_SETMASK, &sigs, &old);
    while (p->helpers < helpers) {
        pthread_t t;
        if (pthread_create(&t, NULL, gather_helper, p) != 0) {
            p->grow_failed = 1;
            break;
        }
        pthread_detach(t);
        __atomic_fetch_add(&p->helpers, 1, __ATOMIC_RELAXED);
        p->fresh = 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static int
gather_pool_run(const GatherJob *j, int64_t total, int threads)
{
    GatherPool *p = &gather_pool;
    if (__atomic_exchange_n(&p->busy, 1, __ATOMIC_ACQUIRE))
        return 0;
    if (p->skip > 0) {
        p->skip--, p->fresh = 1;
        __atomic_fetch_add(&p->skipped, 1, __ATOMIC_RELAXED);
        __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
        return 0;
    }
    pthread_mutex_lock(&p->mu);
    if (!p->atfork)
        p->atfork = pthread_atfork(gather_pool_prefork, gather_pool_postfork_parent,
                                   gather_pool_postfork_child) == 0;
    gather_pool_grow(p, threads - 1);
    if (p->helpers == 0) {
        pthread_mutex_unlock(&p->mu);
        __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
        return 0;
    }
    int judged = !p->fresh;
    p->fresh = 0;
    p->job = *j;
    p->total = total;
    p->grain = j->chunk < GATHER_GRAIN_BYTES ? GATHER_GRAIN_BYTES / j->chunk : 1;
    p->next = 0;
    p->want = threads - 1;
    p->open = 1;
    __atomic_store_n(&p->seq, p->seq + 1, __ATOMIC_RELEASE);
    if (p->sleeping)
        pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    int64_t t0 = gather_now_ns();
    gather_take(p, 0);
    pthread_mutex_lock(&p->mu);
    p->open = 0;
    pthread_mutex_unlock(&p->mu);
    int64_t t1 = gather_now_ns();
    for (unsigned k = 1; __atomic_load_n(&p->inside, __ATOMIC_ACQUIRE); k++) {
        gather_pause();
        if (k % 64 == 0)
            sched_yield();   /* the helper we wait for may want this CPU */
    }
    int64_t t2 = gather_now_ns();
    __atomic_fetch_add(&p->shared, 1, __ATOMIC_RELAXED);
    if (judged && t2 - t1 > GATHER_WAIT_NS && 4 * (t2 - t1) > t2 - t0) {
        p->backoff = p->backoff < GATHER_BACKOFF_MIN ? GATHER_BACKOFF_MIN
                   : p->backoff < GATHER_BACKOFF_MAX ? 2 * p->backoff : GATHER_BACKOFF_MAX;
        p->skip = p->backoff;
        __atomic_fetch_add(&p->backoffs, 1, __ATOMIC_RELAXED);
    } else if (judged) {
        p->backoff /= 2;
    }
    __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
    return 1;
}

__attribute__((unused)) static void
gather_pool_stats(int64_t out[4])
{
    GatherPool *p = &gather_pool;
    out[0] = __atomic_load_n(&p->helpers, __ATOMIC_RELAXED);
    out[1] = __atomic_load_n(&p->shared, __ATOMIC_RELAXED);
    out[2] = __atomic_load_n(&p->skipped, __ATOMIC_RELAXED);
    out[3] = __atomic_load_n(&p->backoffs, __ATOMIC_RELAXED);
}

#endif
