// The router trace's ring (tools/server/server-router-trace.h, patch 0004) without a model: decodes are fed as
// the eval callback would leave them -- layer 1 with the picks of every row of the batch, layer 3, the last, with
// those of the output rows only, as llama.cpp computes it -- and the ring's trace goes to stdout for
// tests/backend/test_router_trace_ring.py to read. The picks of decode d, row r, layer L, rank j are
// (10 * d + 2 * r + j + L) % 64.

#include "server-router-trace.h"

#include <cstdio>
#include <vector>

static const int LAYERS[] = {1, 3};

// `outputs`: the batch's output rows; `rows`: its generated tokens (outputs all)
static void decode(server_router_trace & rt, int d, int n_rows, const std::vector<int32_t> & outputs,
                   const std::vector<int32_t> & rows, const std::vector<int32_t> & slots, bool drop_a_layer = false) {
    rt.begin(true);
    for (int layer : LAYERS) {
        if (drop_a_layer && layer == 3) {
            continue;
        }
        auto & v = rt.picks[layer];
        for (int r = 0; r < n_rows; r++) {
            bool out = false;
            for (int32_t o : outputs) {
                out = out || o == r;
            }
            if (layer == 3 && !out) {
                continue;
            }
            for (int j = 0; j < 2; j++) {
                v.push_back((10 * d + 2 * r + j + layer) % 64);
            }
        }
    }
    std::vector<int32_t> outs;   // each generated token's place among the outputs
    for (int32_t row : rows) {
        for (size_t o = 0; o < outputs.size(); o++) {
            if (outputs[o] == row) {
                outs.push_back((int32_t) o);
            }
        }
    }
    rt.k = 2;
    rt.end(n_rows, (int32_t) outputs.size(), rows, outs, slots);
}

int main() {
    server_router_trace rt;
    rt.capacity = 5;
    rt.n_expert = 64;
    uint64_t recorded = 0, skipped = 0;
    if (!rt.trace(recorded, skipped).empty()) {
        return 1;                                   // nothing recorded: no trace
    }
    decode(rt, 0, 2, {0, 1}, {0, 1}, {0, 1});             // two streams decode together
    decode(rt, 1, 4, {1, 3}, {1}, {1});                   // a prompt row, slot 1's token, the rest of the prompt
    decode(rt, 2, 2, {0, 1}, {0, 1}, {0, 1});
    decode(rt, 3, 1, {0}, {0}, {0});                      // the sixth token: the ring of 5 drops the first
    decode(rt, 4, 2, {0, 1}, {0, 1}, {0, 1}, true);       // a layer's picks missing: both tokens skipped
    rt.skip(3);                                           // (a batch whose rows were not attributable)
    rt.begin(false);                                      // a prompt: nothing asked, nothing kept
    rt.end(4, 1, {0}, {0}, {0});
    const std::string out = rt.trace(recorded, skipped);
    std::fwrite(out.data(), 1, out.size(), stdout);
    std::fprintf(stderr, "recorded %llu skipped %llu\n", (unsigned long long) recorded, (unsigned long long) skipped);
    return 0;
}
