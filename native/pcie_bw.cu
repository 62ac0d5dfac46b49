/* pcie_bw: pinned host<->device copy bandwidth per GPU, with the host buffer on each NUMA node in turn.
 *
 *   pcie_bw --node 0:0-7 --node 1:8-15 [--devices all|0,1] [--bytes 268435456] [--reps 8]
 *           [--alloc register|hostalloc]
 *
 * For each NUMA node (outer loop, so each host buffer is allocated, touched and pinned once): the thread is
 * pinned to the node's CPUs, the buffer is bound to the node (mbind MPOL_BIND), touched, its placement checked
 * (move_pages) and pinned with cudaHostRegister(Portable) (--alloc hostalloc: cudaHostAlloc(Portable) with the
 * thread's memory policy bound to the node instead, what frameworks' pinned allocators do). Then for each GPU: one warm-up copy each way and
 * --reps timed cudaMemcpyAsync copies each way, timed with CUDA events (the same call a framework's pinned
 * copy makes). Best and median bandwidths are reported. Devices are identified by PCI bus id (run with
 * CUDA_DEVICE_ORDER=PCI_BUS_ID). One JSON object per line on stdout.
 * Built on demand by orchestrator with nvcc (no device code: any architecture). Written for orchestrator (MIT).
 */
#include "probe_common.h"

#include <cuda_runtime.h>

#define MAX_DEV 64
#define MAX_NODE_ARGS 256

static void usage(void) {
    fprintf(stderr, "usage: pcie_bw --node NODE:CPULIST [--node ...] [--devices all|LIST] [--bytes N] [--reps N] "
                    "[--alloc register|hostalloc]\n");
    exit(2);
}

#define CK(call, what)                                                                                  \
    do {                                                                                                \
        cudaError_t e_ = (call);                                                                        \
        if (e_ != cudaSuccess) {                                                                        \
            snprintf(err, sizeof(err), "%s: %s", what, cudaGetErrorString(e_));                         \
            goto fail;                                                                                  \
        }                                                                                               \
    } while (0)

int main(int argc, char **argv) {
    int node_id[MAX_NODE_ARGS];
    char *node_cpus[MAX_NODE_ARGS];
    int n_nodes = 0;
    const char *devices = "all";
    size_t bytes = (size_t)256 << 20;
    int reps = 8;
    int hostalloc = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--node") && i + 1 < argc) {
            char *spec = argv[++i], *colon = strchr(spec, ':');
            if (!colon || n_nodes >= MAX_NODE_ARGS) usage();
            *colon = 0;
            node_id[n_nodes] = atoi(spec);
            node_cpus[n_nodes++] = colon + 1;
        } else if (!strcmp(argv[i], "--devices") && i + 1 < argc) {
            devices = argv[++i];
        } else if (!strcmp(argv[i], "--bytes") && i + 1 < argc) {
            bytes = (size_t)strtoull(argv[++i], NULL, 10);
        } else if (!strcmp(argv[i], "--reps") && i + 1 < argc) {
            reps = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--alloc") && i + 1 < argc) {
            i++;
            if (!strcmp(argv[i], "hostalloc")) hostalloc = 1;
            else if (strcmp(argv[i], "register")) usage();
        } else {
            usage();
        }
    }
    if (n_nodes <= 0 || reps <= 0 || bytes < ((size_t)1 << 20)) usage();

    char err[512] = "";
    int count = 0;
    double t_init = orch_now();
    cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0) {
        printf("{\"kind\":\"init\",\"error\":\"no CUDA device: %s\"}\n",
               ce != cudaSuccess ? cudaGetErrorString(ce) : "cudaGetDeviceCount returned 0");
        return 3;
    }
    int devs[MAX_DEV], n_dev = 0;
    if (!strcmp(devices, "all")) {
        for (int d = 0; d < count && d < MAX_DEV; d++) devs[n_dev++] = d;
    } else {
        n_dev = orch_parse_list(devices, devs, MAX_DEV);
        if (n_dev <= 0) usage();
    }
    void *dbuf[MAX_DEV] = {0};
    cudaStream_t stream[MAX_DEV];
    cudaEvent_t ev0[MAX_DEV], ev1[MAX_DEV];
    double dev_seconds[MAX_DEV];
    char pci[MAX_DEV][32];
    for (int i = 0; i < n_dev; i++) {
        double t = orch_now();
        CK(cudaSetDevice(devs[i]), "cudaSetDevice");
        CK(cudaFree(0), "CUDA context");
        CK(cudaMalloc(&dbuf[i], bytes), "cudaMalloc");
        CK(cudaStreamCreateWithFlags(&stream[i], cudaStreamNonBlocking), "cudaStreamCreate");
        CK(cudaEventCreate(&ev0[i]), "cudaEventCreate");
        CK(cudaEventCreate(&ev1[i]), "cudaEventCreate");
        CK(cudaDeviceGetPCIBusId(pci[i], sizeof(pci[i]), devs[i]), "cudaDeviceGetPCIBusId");
        dev_seconds[i] = orch_now() - t;
        printf("{\"kind\":\"device\",\"device\":%d,\"pci\":\"%s\",\"init_seconds\":%.3f}\n", devs[i], pci[i],
               dev_seconds[i]);
    }
    fflush(stdout);

    for (int k = 0; k < n_nodes; k++) {
        static int cpus[ORCH_MAX_CPUS];
        int ncpu = orch_parse_list(node_cpus[k], cpus, ORCH_MAX_CPUS);
        if (ncpu > 0) orch_pin_to_cpus(cpus, ncpu);
        double t_alloc = orch_now();
        void *host = NULL;
        int placed = -1;
        const char *placement = hostalloc ? "membind" : "mbind";
        if (hostalloc) {
            if (orch_thread_membind(node_id[k]) != 0) {
                if (errno != EPERM && errno != ENOSYS) {
                    printf("{\"kind\":\"gpu\",\"node\":%d,\"error\":\"cannot bind memory to node %d: %s\"}\n",
                           node_id[k], node_id[k], strerror(errno));
                    fflush(stdout);
                    continue;
                }
                placement = "first-touch";  /* not permitted here: the pinned thread's node is used */
            }
            cudaError_t ae = cudaHostAlloc(&host, bytes, cudaHostAllocPortable);
            if (ae == cudaSuccess) memset(host, 1, bytes);
            orch_thread_membind(-1);
            if (ae != cudaSuccess) {
                printf("{\"kind\":\"gpu\",\"node\":%d,\"error\":\"cudaHostAlloc: %s\"}\n", node_id[k],
                       cudaGetErrorString(ae));
                fflush(stdout);
                continue;
            }
            placed = orch_node_of(host, bytes);
        } else {
            int how = 0;
            host = orch_alloc_on_node(bytes, node_id[k], &how);
            if (host && how == ORCH_PLACED_FIRST_TOUCH) placement = "first-touch";
            if (!host) {
                printf("{\"kind\":\"gpu\",\"node\":%d,\"error\":\"cannot bind %zu bytes to node %d: %s\"}\n",
                       node_id[k], bytes, node_id[k], strerror(errno));
                fflush(stdout);
                continue;
            }
#ifdef MADV_HUGEPAGE
            madvise(host, bytes, MADV_HUGEPAGE);  /* fewer, larger pages to pin and map for DMA */
#endif
            memset(host, 1, bytes);
            placed = orch_node_of(host, bytes);
            cudaError_t re = cudaHostRegister(host, bytes, cudaHostRegisterPortable);
            if (re != cudaSuccess) {
                printf("{\"kind\":\"gpu\",\"node\":%d,\"error\":\"cudaHostRegister: %s\"}\n", node_id[k],
                       cudaGetErrorString(re));
                munmap(host, bytes);
                fflush(stdout);
                continue;
            }
        }
        double alloc_s = orch_now() - t_alloc;
        for (int i = 0; i < n_dev; i++) {
            double t = orch_now();
            double h2d[1024], d2h[1024];
            int r_max = reps > 1024 ? 1024 : reps;
            CK(cudaSetDevice(devs[i]), "cudaSetDevice");
            for (int dir = 0; dir < 2; dir++) {
                for (int r = -1; r < r_max; r++) {
                    CK(cudaEventRecord(ev0[i], stream[i]), "cudaEventRecord");
                    if (dir == 0)
                        CK(cudaMemcpyAsync(dbuf[i], host, bytes, cudaMemcpyHostToDevice, stream[i]), "H2D copy");
                    else
                        CK(cudaMemcpyAsync(host, dbuf[i], bytes, cudaMemcpyDeviceToHost, stream[i]), "D2H copy");
                    CK(cudaEventRecord(ev1[i], stream[i]), "cudaEventRecord");
                    CK(cudaEventSynchronize(ev1[i]), "cudaEventSynchronize");
                    float ms = 0;
                    CK(cudaEventElapsedTime(&ms, ev0[i], ev1[i]), "cudaEventElapsedTime");
                    if (r >= 0) (dir == 0 ? h2d : d2h)[r] = (double)bytes / (ms * 1e-3);
                }
            }
            double secs = orch_now() - t;
            dev_seconds[i] += secs;
            printf("{\"kind\":\"gpu\",\"device\":%d,\"pci\":\"%s\",\"node\":%d,\"placed_node\":%d,\"bytes\":%zu,"
                   "\"reps\":%d,\"h2d_best\":%.0f,\"h2d_median\":%.0f,\"d2h_best\":%.0f,\"d2h_median\":%.0f,"
                   "\"seconds\":%.3f,\"host_alloc_seconds\":%.3f,\"alloc\":\"%s\",\"placement\":\"%s\"}\n",
                   devs[i], pci[i], node_id[k], placed, bytes, r_max, orch_max(h2d, r_max),
                   orch_median(h2d, r_max), orch_max(d2h, r_max), orch_median(d2h, r_max), secs, alloc_s,
                   hostalloc ? "hostalloc" : "register", placement);
            fflush(stdout);
        }
        if (hostalloc) {
            cudaFreeHost(host);
        } else {
            cudaHostUnregister(host);
            munmap(host, bytes);
        }
    }
    printf("{\"kind\":\"done\",\"seconds\":%.3f}\n", orch_now() - t_init);
    return 0;

fail:
    printf("{\"kind\":\"error\",\"error\":\"%s\"}\n", err);
    return 1;
}
