/* Shared helpers of orchestrator's native probes: CPU lists, thread pinning, memory bound to a NUMA node.
 *
 * No libnuma headers needed: mbind(2) and move_pages(2) are called through syscall(2), so the probes build
 * with a bare C compiler on any Linux. Written for orchestrator (MIT).
 */
#ifndef ORCH_PROBE_COMMON_H
#define ORCH_PROBE_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ORCH_MPOL_BIND 2
#define ORCH_MAX_NODES 1024
#define ORCH_MAX_CPUS 8192

static inline double orch_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Parse "0-3,8,10-11" into out[] (at most cap entries). Returns the count, or -1 on a syntax error. */
static inline int orch_parse_list(const char *s, int *out, int cap) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        long a = strtol(p, &end, 10);
        if (end == p || a < 0) return -1;
        long b = a;
        p = end;
        if (*p == '-') {
            p++;
            b = strtol(p, &end, 10);
            if (end == p || b < a) return -1;
            p = end;
        }
        for (long c = a; c <= b; c++) {
            if (n >= cap) return -1;
            out[n++] = (int)c;
        }
        if (*p == ',') p++;
        else if (*p) return -1;
    }
    return n;
}

static inline int orch_pin_to_cpus(const int *cpus, int n) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int i = 0; i < n; i++) CPU_SET(cpus[i], &set);
    return sched_setaffinity(0, sizeof(set), &set);
}

/* How a buffer was placed on its node. */
#define ORCH_PLACED_MBIND 1        /* mbind(MPOL_BIND): the kernel guarantees the node */
#define ORCH_PLACED_FIRST_TOUCH 2  /* mbind refused (seccomp/containers: EPERM, ENOSYS): pages land where the
                                      touching thread runs, so the caller must touch from the node's CPUs */

/* Anonymous memory whose pages must come from NUMA node `node` (node < 0: default policy); *how says how.
 * Returns NULL with errno set when the node cannot be bound (not allowed by the cpuset, no memory ...). */
static inline void *orch_alloc_on_node(size_t bytes, int node, int *how) {
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (how) *how = ORCH_PLACED_MBIND;
    if (node >= 0) {
        unsigned long mask[ORCH_MAX_NODES / (8 * sizeof(unsigned long))];
        memset(mask, 0, sizeof(mask));
        if (node >= ORCH_MAX_NODES) { munmap(p, bytes); errno = EINVAL; return NULL; }
        mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
        if (syscall(SYS_mbind, p, bytes, ORCH_MPOL_BIND, mask, (unsigned long)ORCH_MAX_NODES + 1, 0) != 0) {
            int e = errno;
            if ((e == EPERM || e == ENOSYS) && how) {
                *how = ORCH_PLACED_FIRST_TOUCH;
                return p;
            }
            munmap(p, bytes);
            errno = e;
            return NULL;
        }
    }
    return p;
}

/* Bind (node >= 0) or reset (node < 0) this thread's memory policy: for allocators we do not control
 * (cudaHostAlloc), whose pages are then taken from `node`. Returns 0 or -1 with errno set. */
static inline int orch_thread_membind(int node) {
    if (node < 0) return (int)syscall(SYS_set_mempolicy, 0 /* MPOL_DEFAULT */, NULL, 0UL);
    unsigned long mask[ORCH_MAX_NODES / (8 * sizeof(unsigned long))];
    memset(mask, 0, sizeof(mask));
    if (node >= ORCH_MAX_NODES) { errno = EINVAL; return -1; }
    mask[node / (8 * sizeof(unsigned long))] |= 1UL << (node % (8 * sizeof(unsigned long)));
    return (int)syscall(SYS_set_mempolicy, ORCH_MPOL_BIND, mask, (unsigned long)ORCH_MAX_NODES + 1);
}

/* The NUMA node most of a buffer's pages live on (sampling up to 64 pages), -1 if the kernel will not say. */
static inline int orch_node_of(void *buf, size_t bytes) {
    long page = sysconf(_SC_PAGESIZE);
    enum { SAMPLES = 64 };
    void *pages[SAMPLES];
    int status[SAMPLES];
    size_t npages = bytes / (size_t)page;
    int n = npages < SAMPLES ? (int)npages : SAMPLES;
    if (n <= 0) return -1;
    for (int i = 0; i < n; i++) pages[i] = (char *)buf + ((npages * (size_t)i) / (size_t)n) * (size_t)page;
    if (syscall(SYS_move_pages, 0, (unsigned long)n, pages, NULL, status, 0) != 0) return -1;
    int best = -1, best_count = 0;
    for (int i = 0; i < n; i++) {
        if (status[i] < 0) continue;
        int count = 0;
        for (int j = 0; j < n; j++) count += status[j] == status[i];
        if (count > best_count) { best = status[i]; best_count = count; }
    }
    return best;
}

static int orch_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static inline double orch_median(double *v, int n) {
    qsort(v, (size_t)n, sizeof(double), orch_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static inline double orch_max(const double *v, int n) {
    double m = 0;
    for (int i = 0; i < n; i++) if (v[i] > m) m = v[i];
    return m;
}

#endif
