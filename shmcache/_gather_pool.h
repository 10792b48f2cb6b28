/* shmcache/_gather_pool.h: the helper threads of large gathers, kept from one
 * call to the next. Included by _gather.h (after GatherJob and gather_run);
 * each module that includes it has its own pool.
 *
 * gather_pool_run(job, total, threads) runs tasks [0, total) of `job` on the
 * calling thread and on up to threads-1 helpers, and returns 1 once every
 * task has run; it returns 0 (nothing run) when another thread of this
 * process is using the pool or no helper can be started: the caller then runs
 * the job alone.
 *
 * Invariant: every task runs exactly once, and no helper touches a job after
 * gather_pool_run has returned. NOTE: why it holds: tasks are claimed in
 * grains from one counter (`next`), so two threads never claim the same
 * task; a helper joins a job only under the mutex and only while it is
 * `open`; the caller closes it under the same mutex once it finds no task
 * left to claim, then waits until `inside` (helpers that joined) is zero.
 * `next` and the job are only reset by the next call, under the mutex, with
 * no helper inside, so a late helper cannot claim from a half-set job.
 *
 * NOTE: why helpers are kept, and spin before they sleep: on the development
 * VM (2 vCPUs) an 8 MiB memcpy split over two threads took 101-131 us with a
 * helper still spinning, 175-586 us with one woken by a condition variable
 * (795-1254 us after 2 ms idle, when it sleeps), 173-783 us with a thread
 * started per call, and 224-322 us on one thread (tools/handoff.c, five
 * runs). So a helper spins (GATHER_SPIN_NS, about what one large gather
 * takes) after each job, as OpenMP's and OpenBLAS's threads do, then sleeps
 * on the condition variable.
 * The claims are what make a late helper harmless: the caller starts on the
 * work at once, and a helper that arrives after the last grain was claimed
 * costs the caller nothing but the mutex.
 *
 * After fork() the child has no helpers: pthread_atfork resets the pool.
 */
#ifndef SHMCACHE_GATHER_POOL_H
#define SHMCACHE_GATHER_POOL_H

#include <signal.h>
#include <time.h>

#define GATHER_GRAIN_BYTES (128 << 10)
#define GATHER_SPIN_NS 300000

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    GatherJob job;
    int64_t total, grain, next;   /* next: the first unclaimed task */
    uint64_t seq;                 /* bumped when a job is posted */
    int open, want, inside, sleeping, helpers, busy, atfork;
} GatherPool;

static GatherPool gather_pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER};

static void
gather_pause(void)
{
#if defined(__x86_64__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t
gather_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void
gather_take(GatherPool *p)
{
    GatherJob g = p->job;
    for (;;) {
        int64_t t = __atomic_fetch_add(&p->next, p->grain, __ATOMIC_RELAXED);
        if (t >= p->total)
            return;
        g.begin = t, g.end = t + p->grain < p->total ? t + p->grain : p->total;
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
        if (k % 64 == 0 && gather_now_ns() > until)
            break;
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
        int join = p->open && p->seq == seen && p->inside < p->want;
        if (join)
            __atomic_fetch_add(&p->inside, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&p->mu);
        if (join) {
            gather_take(p);
            __atomic_fetch_sub(&p->inside, 1, __ATOMIC_RELEASE);
        }
    }
    return NULL;
}

static void
gather_pool_forked(void)
{
    GatherPool *p = &gather_pool;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    p->open = p->inside = p->sleeping = p->helpers = p->busy = 0;
}

/* Under the mutex. Helpers block every signal: they belong to the caller. */
static void
gather_pool_grow(GatherPool *p, int helpers)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    while (p->helpers < helpers) {
        pthread_t t;
        if (pthread_create(&t, NULL, gather_helper, p) != 0)
            break;
        pthread_detach(t);
        p->helpers++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

static int
gather_pool_run(const GatherJob *j, int64_t total, int threads)
{
    GatherPool *p = &gather_pool;
    if (__atomic_exchange_n(&p->busy, 1, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&p->mu);
    if (!p->atfork)
        p->atfork = pthread_atfork(NULL, NULL, gather_pool_forked) == 0;
    gather_pool_grow(p, threads - 1);
    if (p->helpers == 0) {
        pthread_mutex_unlock(&p->mu);
        __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
        return 0;
    }
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
    gather_take(p);
    pthread_mutex_lock(&p->mu);
    p->open = 0;
    pthread_mutex_unlock(&p->mu);
    while (__atomic_load_n(&p->inside, __ATOMIC_ACQUIRE))
        gather_pause();
    __atomic_store_n(&p->busy, 0, __ATOMIC_RELEASE);
    return 1;
}

#endif
