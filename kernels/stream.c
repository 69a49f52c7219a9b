/* STREAM-like memory bandwidth kernels (copy, triad) for edgerun's bandwidth probe.
 *
 * Built at run time by edgerun/hw/kernels.py with the system C compiler
 *   cc -O3 -shared -fPIC -pthread stream.c -o libstream.so
 * and called through ctypes. Each thread owns a contiguous slice of the arrays and touches it
 * first (so pages land near the thread that uses them). Bytes counted per element as STREAM
 * does: copy c = b moves 16 B (read b, write c), triad a = b + s*c moves 24 B. Values stay fixed
 * from one repetition to the next (c = 2, a = 8), which the caller checks.
 */
#include <pthread.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { OP_INIT = 0, OP_COPY = 1, OP_TRIAD = 2 };

typedef struct {
    double *a, *b, *c;
    size_t lo, hi;
    double s;
    int op;
} job_t;

static void *worker(void *arg) {
    job_t *j = (job_t *)arg;
    double *restrict a = j->a, *restrict b = j->b, *restrict c = j->c;
    const double s = j->s;
    size_t i;
    switch (j->op) {
    case OP_INIT:
        for (i = j->lo; i < j->hi; i++) { a[i] = 1.0; b[i] = 2.0; c[i] = 0.5; }
        break;
    case OP_COPY:
        /* memcpy: the C library's large-copy path (non-temporal stores where it pays), as any real
         * copy uses; the element loop would add write-allocate traffic that STREAM does not count */
        memcpy(c + j->lo, b + j->lo, (j->hi - j->lo) * sizeof(double));
        break;
    case OP_TRIAD:
        for (i = j->lo; i < j->hi; i++) a[i] = b[i] + s * c[i];
        break;
    }
    return NULL;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Run `op` on all threads (the calling thread takes slice 0); return elapsed seconds. */
static double run(job_t *jobs, pthread_t *th, int nt, int op) {
    int t;
    double t0 = now_s();
    for (t = 0; t < nt; t++) jobs[t].op = op;
    for (t = 1; t < nt; t++)
        if (pthread_create(&th[t], NULL, worker, &jobs[t]) != 0) return -1.0;
    worker(&jobs[0]);
    for (t = 1; t < nt; t++) pthread_join(th[t], NULL);
    return now_s() - t0;
}

/* n doubles per array, nthreads threads, reps repetitions.
 * out[0], out[1]: best copy / triad seconds; out[2]: checksum of a (sanity: the work was done).
 * Returns 0 on success, 1 on allocation failure, 2 on thread failure, 3 on bad arguments. */
int edgerun_stream(uint64_t n, int nthreads, int reps, double *out) {
    double *a, *b, *c, best_copy = 1e30, best_triad = 1e30, sum = 0.0;
    job_t *jobs;
    pthread_t *th;
    int t, r;
    if (n < 1024 || nthreads < 1 || reps < 1 || out == NULL) return 3;
    a = (double *)aligned_alloc(4096, ((n * sizeof(double) + 4095) / 4096) * 4096);
    b = (double *)aligned_alloc(4096, ((n * sizeof(double) + 4095) / 4096) * 4096);
    c = (double *)aligned_alloc(4096, ((n * sizeof(double) + 4095) / 4096) * 4096);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    /* transparent huge pages, as numpy asks for its large arrays: fewer TLB misses */
    if (a) madvise(a, ((n * sizeof(double) + 4095) / 4096) * 4096, MADV_HUGEPAGE);
    if (b) madvise(b, ((n * sizeof(double) + 4095) / 4096) * 4096, MADV_HUGEPAGE);
    if (c) madvise(c, ((n * sizeof(double) + 4095) / 4096) * 4096, MADV_HUGEPAGE);
#endif
    jobs = (job_t *)calloc((size_t)nthreads, sizeof(job_t));
    th = (pthread_t *)calloc((size_t)nthreads, sizeof(pthread_t));
    if (!a || !b || !c || !jobs || !th) {
        free(a); free(b); free(c); free(jobs); free(th);
        return 1;
    }
    for (t = 0; t < nthreads; t++) {
        jobs[t].a = a; jobs[t].b = b; jobs[t].c = c; jobs[t].s = 3.0;
        jobs[t].lo = n * (uint64_t)t / (uint64_t)nthreads;
        jobs[t].hi = n * (uint64_t)(t + 1) / (uint64_t)nthreads;
    }
    if (run(jobs, th, nthreads, OP_INIT) < 0) goto thread_fail;
    for (r = 0; r < reps; r++) {
        double tc = run(jobs, th, nthreads, OP_COPY);
        double tt = run(jobs, th, nthreads, OP_TRIAD);
        if (tc < 0 || tt < 0) goto thread_fail;
        if (tc < best_copy) best_copy = tc;
        if (tt < best_triad) best_triad = tt;
    }
    for (uint64_t i = 0; i < n; i += 4093) sum += a[i];
    out[0] = best_copy; out[1] = best_triad; out[2] = sum;
    free(a); free(b); free(c); free(jobs); free(th);
    return 0;
thread_fail:
    free(a); free(b); free(c); free(jobs); free(th);
    return 2;
}
