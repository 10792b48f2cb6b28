/* tools/handoff.c: what handing half of a memcpy to a second thread costs,
 * by how that thread is got (the measurement behind _gather_pool.h).
 *
 *     cc -O2 -pthread tools/handoff.c -o /tmp/handoff && /tmp/handoff 8192
 *
 * Copies N KiB (argument) between two private buffers: on one thread; split
 * with a thread started per call; with a kept helper woken through a
 * condition variable (back to back, and after 2 ms idle, when it sleeps);
 * and with a kept helper that spins. Medians of 301 calls, microseconds.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct { size_t a, b; } Job;
static char *S, *D;
static size_t N;
static Job half;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t go_cv = PTHREAD_COND_INITIALIZER, done_cv = PTHREAD_COND_INITIALIZER;
static int go, done;
static atomic_int spin_go, spin_done;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec / 1e3; }
static void *run(void *p) { Job *j = p; memcpy(D + j->a, S + j->a, j->b - j->a); return NULL; }
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return x < y ? -1 : x > y; }

static void *sleeper(void *p)
{
    for (;;) {
        pthread_mutex_lock(&mu);
        while (!go) pthread_cond_wait(&go_cv, &mu);
        go = 0;
        pthread_mutex_unlock(&mu);
        run(&half);
        pthread_mutex_lock(&mu);
        done = 1;
        pthread_cond_signal(&done_cv);
        pthread_mutex_unlock(&mu);
    }
    return p;
}

static void *spinner(void *p)
{
    for (;;) {
        while (!atomic_load(&spin_go)) ;
        atomic_store(&spin_go, 0);
        run(&half);
        atomic_store(&spin_done, 1);
    }
    return p;
}

static double median(int how, int idle_us)
{
    double ts[301];
    for (int i = 0; i < 301; i++) {
        if (idle_us) usleep(idle_us);
        Job mine = {0, N / 2};
        half = (Job){N / 2, N};
        double t = now();
        if (how == 0) {
            Job all = {0, N};
            run(&all);
        } else if (how == 1) {
            pthread_t th;
            pthread_create(&th, NULL, run, &half);
            run(&mine);
            pthread_join(th, NULL);
        } else if (how == 2) {
            pthread_mutex_lock(&mu); go = 1; pthread_cond_signal(&go_cv); pthread_mutex_unlock(&mu);
            run(&mine);
            pthread_mutex_lock(&mu); while (!done) pthread_cond_wait(&done_cv, &mu); done = 0; pthread_mutex_unlock(&mu);
        } else {
            atomic_store(&spin_go, 1);
            run(&mine);
            while (!atomic_load(&spin_done)) ;
            atomic_store(&spin_done, 0);
        }
        ts[i] = now() - t;
    }
    qsort(ts, 301, sizeof ts[0], cmp);
    return ts[150];
}

int main(int argc, char **argv)
{
    N = (size_t)(argc > 1 ? atol(argv[1]) : 8192) << 10;
    S = malloc(N), D = malloc(N);
    memset(S, 1, N), memset(D, 2, N);
    pthread_t t;
    printf("%zu KiB memcpy, median us\n", N >> 10);
    printf("  one thread                       %8.1f\n", median(0, 0));
    printf("  a thread started per call        %8.1f\n", median(1, 0));
    pthread_create(&t, NULL, sleeper, NULL);
    printf("  kept helper, condvar             %8.1f\n", median(2, 0));
    printf("  kept helper, condvar, 2 ms idle  %8.1f\n", median(2, 2000));
    pthread_create(&t, NULL, spinner, NULL);   /* spins from here to exit */
    printf("  kept helper, spinning            %8.1f\n", median(3, 0));
    return 0;
}
