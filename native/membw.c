/* membw: host memory read bandwidth per (CPU node, memory node) pair.
 *
 *   membw --mem-nodes 0,1 --set 0:0-7 --set 1:8-15 [--bytes 536870912] [--reps 5]
 *
 * For each memory node Y: one buffer bound to Y (mbind MPOL_BIND, touched before timing); for each set X:CPUS,
 * one thread pinned on each CPU of the set reads its slice of the buffer (8 independent 64-bit accumulators,
 * vectorised by the compiler), all threads starting together; a pass's time is from the common start to the
 * last thread's end. One warm-up pass, then --reps timed passes: the best and the median are reported.
 * One JSON object per line on stdout; errors for one pair are reported in that pair's line, not fatal.
 * Built on demand by orchestrator (cc -O3 -march=native -pthread). Written for orchestrator (MIT).
 */
#include "probe_common.h"

#include <inttypes.h>

#define MAX_SETS 256

typedef struct {
    int cpu;
    const uint64_t *base;
    size_t words;
    int passes;
    pthread_barrier_t *start, *end;
    double *t_start, *t_end;    /* per pass: when this thread started and finished reading */
    uint64_t sink;
    int pin_error;
} worker_t;

static uint64_t read_slice(const uint64_t *restrict p, size_t n) {
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
        a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
    }
    for (; i < n; i++) a0 += p[i];
    return a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7;
}

static void *worker_main(void *arg) {
    worker_t *w = (worker_t *)arg;
    w->pin_error = orch_pin_to_cpus(&w->cpu, 1) != 0 ? errno : 0;
    uint64_t s = 0;
    for (int r = 0; r < w->passes; r++) {
        pthread_barrier_wait(w->start);
        w->t_start[r] = orch_now();
        s += read_slice(w->base, w->words);
        w->t_end[r] = orch_now();
        pthread_barrier_wait(w->end);
    }
    w->sink = s;
    return NULL;
}

typedef struct {
    int cpu;
    char *base;
    size_t bytes;
} toucher_t;

static void *touch_main(void *arg) {
    toucher_t *t = (toucher_t *)arg;
    orch_pin_to_cpus(&t->cpu, 1);
    memset(t->base, 1, t->bytes);
    return NULL;
}

/* First touch in parallel (page faults dominate on big buffers); the pages land on the bound node anyway. */
static void parallel_touch(char *buf, size_t bytes, const int *cpus, int n) {
    if (n < 1) n = 1;
    toucher_t *t = calloc((size_t)n, sizeof(toucher_t));
    pthread_t *th = calloc((size_t)n, sizeof(pthread_t));
    size_t per = (bytes / (size_t)n) & ~(size_t)4095;
    for (int i = 0; i < n; i++) {
        t[i].cpu = cpus ? cpus[i] : 0;
        t[i].base = buf + per * (size_t)i;
        t[i].bytes = i == n - 1 ? bytes - per * (size_t)i : per;
        pthread_create(&th[i], NULL, touch_main, &t[i]);
    }
    for (int i = 0; i < n; i++) pthread_join(th[i], NULL);
    free(t);
    free(th);
}

static void usage(void) {
    fprintf(stderr, "usage: membw --mem-nodes LIST --set NODE:CPULIST [--set ...] [--bytes N] [--reps N]\n");
    exit(2);
}

int main(int argc, char **argv) {
    static int mem_nodes[ORCH_MAX_NODES];
    int n_mem = 0;
    int set_node[MAX_SETS];
    char *set_cpus_text[MAX_SETS];
    int n_sets = 0;
    size_t bytes = (size_t)512 << 20;
    int reps = 5;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mem-nodes") && i + 1 < argc) {
            n_mem = orch_parse_list(argv[++i], mem_nodes, ORCH_MAX_NODES);
            if (n_mem <= 0) usage();
        } else if (!strcmp(argv[i], "--set") && i + 1 < argc) {
            char *spec = argv[++i], *colon = strchr(spec, ':');
            if (!colon || n_sets >= MAX_SETS) usage();
            *colon = 0;
            set_node[n_sets] = atoi(spec);
            set_cpus_text[n_sets++] = colon + 1;
        } else if (!strcmp(argv[i], "--bytes") && i + 1 < argc) {
            bytes = (size_t)strtoull(argv[++i], NULL, 10);
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else {
            usage();
        }
    }
    if (n_mem <= 0 || n_sets <= 0 || reps <= 0 || bytes < ((size_t)1 << 20)) usage();
    bytes &= ~(size_t)((1 << 20) - 1);

    for (int m = 0; m < n_mem; m++) {
        int node = mem_nodes[m];
        double t_alloc = orch_now();
        int how = 0;
        uint64_t *buf = (uint64_t *)orch_alloc_on_node(bytes, node, &how);
        if (!buf) {
            printf("{\"kind\":\"host\",\"mem_node\":%d,\"error\":\"cannot bind %zu bytes to node %d: %s\"}\n",
                   node, bytes, node, strerror(errno));
            fflush(stdout);
            continue;
        }
#ifdef MADV_HUGEPAGE
        madvise(buf, bytes, MADV_HUGEPAGE);
#endif
        size_t words = bytes / sizeof(uint64_t);
        {   /* touch with the CPUs of the set local to this node if there is one, else of the first set */
            static int tcpus[ORCH_MAX_CPUS];
            int pick = 0, local = 0;
            for (int s = 0; s < n_sets; s++) if (set_node[s] == node) { pick = s; local = 1; break; }
            if (how == ORCH_PLACED_FIRST_TOUCH && !local) {
                printf("{\"kind\":\"host\",\"mem_node\":%d,\"error\":\"mbind is not permitted here and node %d "
                       "has no CPU to touch its memory from\"}\n", node, node);
                fflush(stdout);
                munmap(buf, bytes);
                continue;
            }
            int tn = orch_parse_list(set_cpus_text[pick], tcpus, ORCH_MAX_CPUS);
            if (tn > 0) parallel_touch((char *)buf, bytes, tcpus, tn);
            else memset(buf, 1, bytes);
        }
        int placed = orch_node_of(buf, bytes);
        double alloc_s = orch_now() - t_alloc;

        for (int s = 0; s < n_sets; s++) {
            static int cpus[ORCH_MAX_CPUS];
            int n = orch_parse_list(set_cpus_text[s], cpus, ORCH_MAX_CPUS);
            if (n <= 0) {
                printf("{\"kind\":\"host\",\"mem_node\":%d,\"cpu_node\":%d,\"error\":\"bad CPU list '%s'\"}\n",
                       node, set_node[s], set_cpus_text[s]);
                continue;
            }
            double t0 = orch_now();
            pthread_barrier_t start, end;
            pthread_barrier_init(&start, NULL, (unsigned)n + 1);
            pthread_barrier_init(&end, NULL, (unsigned)n + 1);
            worker_t *w = calloc((size_t)n, sizeof(worker_t));
            pthread_t *th = calloc((size_t)n, sizeof(pthread_t));
            size_t per = words / (size_t)n;
            for (int t = 0; t < n; t++) {
                w[t].cpu = cpus[t];
                w[t].base = buf + per * (size_t)t;
                w[t].words = t == n - 1 ? words - per * (size_t)t : per;
                w[t].passes = reps + 1;
                w[t].start = &start;
                w[t].end = &end;
                w[t].t_start = calloc((size_t)reps + 1, sizeof(double));
                w[t].t_end = calloc((size_t)reps + 1, sizeof(double));
                pthread_create(&th[t], NULL, worker_main, &w[t]);
            }
            for (int r = 0; r < reps + 1; r++) {
                pthread_barrier_wait(&start);
                pthread_barrier_wait(&end);
            }
            uint64_t sink = 0;
            int pin_error = 0;
            for (int t = 0; t < n; t++) {
                pthread_join(th[t], NULL);
                sink ^= w[t].sink;
                if (w[t].pin_error) pin_error = w[t].pin_error;
            }
            /* a pass lasts from the first thread's start to the last thread's end, timed by the threads
             * themselves (the coordinating thread may be scheduled late on a busy machine) */
            double *bw = calloc((size_t)reps, sizeof(double));
            for (int r = 1; r < reps + 1; r++) {
                double a = w[0].t_start[r], b = w[0].t_end[r];
                for (int t = 1; t < n; t++) {
                    if (w[t].t_start[r] < a) a = w[t].t_start[r];
                    if (w[t].t_end[r] > b) b = w[t].t_end[r];
                }
                bw[r - 1] = (double)bytes / (b - a);
            }
            for (int t = 0; t < n; t++) {
                free(w[t].t_start);
                free(w[t].t_end);
            }
            double best = orch_max(bw, reps);
            double med = orch_median(bw, reps);
            if (pin_error) {
                printf("{\"kind\":\"host\",\"mem_node\":%d,\"cpu_node\":%d,\"cpus\":\"%s\",\"error\":"
                       "\"cannot pin a thread: %s\"}\n", node, set_node[s], set_cpus_text[s], strerror(pin_error));
            } else {
                printf("{\"kind\":\"host\",\"mem_node\":%d,\"cpu_node\":%d,\"cpus\":\"%s\",\"threads\":%d,"
                       "\"bytes\":%zu,\"reps\":%d,\"best_bytes_per_s\":%.0f,\"median_bytes_per_s\":%.0f,"
                       "\"placed_node\":%d,\"placement\":\"%s\",\"alloc_seconds\":%.3f,\"seconds\":%.3f,"
                       "\"checksum\":%" PRIu64 "}\n",
                       node, set_node[s], set_cpus_text[s], n, bytes, reps, best, med, placed,
                       how == ORCH_PLACED_MBIND ? "mbind" : "first-touch", alloc_s,
                       orch_now() - t0, sink & 0xff);
            }
            fflush(stdout);
            free(bw);
            free(w);
            free(th);
            pthread_barrier_destroy(&start);
            pthread_barrier_destroy(&end);
        }
        munmap(buf, bytes);
    }
    return 0;
}
