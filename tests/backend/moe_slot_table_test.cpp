// Slot assignment and eviction order, and expert recency, of the expert cache (ggml-moe-cache.h from our llama.cpp patch series),
// linked against the cached build's libggml-base. Prints one line per failed check; exits 1 if any failed.
#include "ggml-moe-cache.h"

#include <cstdio>
#include <vector>

static int failures = 0;
#define CHECK(cond) do { if (!(cond)) { std::printf("FAILED line %d: %s\n", __LINE__, #cond); failures++; } } while (0)

struct result {
    bool ok;
    std::vector<int32_t> slots;
    std::vector<int8_t> loads;
};

static result assign(ggml_moe_slot_table_t t, std::vector<int32_t> experts) {
    result r;
    r.slots.assign(experts.size(), -7);
    r.loads.assign(experts.size(), -7);
    r.ok = ggml_moe_slot_table_assign(t, experts.data(), (int32_t) experts.size(), r.slots.data(), r.loads.data());
    return r;
}

int main() {
    CHECK(ggml_moe_slot_table_new(0, 4) == nullptr);
    CHECK(ggml_moe_slot_table_new(8, 0) == nullptr);

    ggml_moe_slot_table_t t = ggml_moe_slot_table_new(16, 4);
    CHECK(ggml_moe_slot_table_n_slots(t) == 4);

    // empty slots are filled lowest index first, every expert is a load
    result r = assign(t, {5, 9});
    CHECK(r.ok && r.slots[0] == 0 && r.slots[1] == 1 && r.loads[0] == 1 && r.loads[1] == 1);
    CHECK(ggml_moe_slot_table_slot_of(t, 5) == 0 && ggml_moe_slot_table_expert_in(t, 1) == 9);

    // a hit keeps its slot and loads nothing; the misses take the remaining empty slots
    r = assign(t, {9, 3, 4});
    CHECK(r.ok && r.slots[0] == 1 && r.loads[0] == 0);
    CHECK(r.slots[1] == 2 && r.loads[1] == 1 && r.slots[2] == 3 && r.loads[2] == 1);

    // full: recency is 5 (oldest), then 9, 3, 4 (newest). A miss evicts 5, the least recently used.
    r = assign(t, {7});
    CHECK(r.ok && r.slots[0] == 0 && r.loads[0] == 1);
    CHECK(ggml_moe_slot_table_slot_of(t, 5) == -1 && ggml_moe_slot_table_slot_of(t, 7) == 0);

    // a hit refreshes: 9 used now, so the next victim is 3 (slot 2), then 4 (slot 3)
    r = assign(t, {9});
    CHECK(r.ok && r.loads[0] == 0);
    r = assign(t, {11});
    CHECK(r.ok && r.slots[0] == 2);
    r = assign(t, {12});
    CHECK(r.ok && r.slots[0] == 3);
    CHECK(ggml_moe_slot_table_slot_of(t, 3) == -1 && ggml_moe_slot_table_slot_of(t, 4) == -1);

    // never evict a slot the same batch uses, even when it is the least recently used one:
    // recency now 7 (oldest), 9, 11, 12. The batch hits 7 and misses 1 and 2: victims are 9 and 11.
    r = assign(t, {1, 7, 2});
    CHECK(r.ok && r.slots[1] == 0 && r.loads[1] == 0);
    CHECK(r.loads[0] == 1 && r.loads[2] == 1);
    CHECK(r.slots[0] == 1 && r.slots[2] == 2);
    CHECK(ggml_moe_slot_table_slot_of(t, 7) == 0 && ggml_moe_slot_table_slot_of(t, 12) == 3);
    CHECK(ggml_moe_slot_table_slot_of(t, 9) == -1 && ggml_moe_slot_table_slot_of(t, 11) == -1);

    // more distinct experts than slots, a repeated id, an id out of range: refused, nothing changes
    r = assign(t, {0, 3, 4, 5, 6});
    CHECK(!r.ok);
    r = assign(t, {13, 13});
    CHECK(!r.ok);
    r = assign(t, {13, 16});
    CHECK(!r.ok);
    CHECK(ggml_moe_slot_table_slot_of(t, 13) == -1);
    CHECK(ggml_moe_slot_table_slot_of(t, 1) == 1 && ggml_moe_slot_table_slot_of(t, 2) == 2);
    CHECK(ggml_moe_slot_table_slot_of(t, 7) == 0 && ggml_moe_slot_table_slot_of(t, 12) == 3);

    // a batch as large as the cache replaces everything it does not hit, each slot once
    r = assign(t, {20 % 16, 14, 15, 12});
    CHECK(r.ok);
    std::vector<int> seen(4, 0);
    for (int32_t s : r.slots) { if (s >= 0 && s < 4) { seen[s]++; } }
    CHECK(seen[0] == 1 && seen[1] == 1 && seen[2] == 1 && seen[3] == 1);
    CHECK(r.slots[3] == 3 && r.loads[3] == 0);

    // an LRU with one slot per expert never misses twice
    ggml_moe_slot_table_t full = ggml_moe_slot_table_new(8, 8);
    int loads = 0;
    for (int round = 0; round < 3; round++) {
        for (int32_t e = 0; e < 8; e++) {
            result q = assign(full, {e, (e + 3) % 8});
            loads += q.loads[0] + q.loads[1];
        }
    }
    CHECK(loads == 8);
    ggml_moe_slot_table_free(full);

    // the state moves between tables (host and device keep one layout): a copy then assigns exactly as the original
    ggml_moe_slot_table_t a = ggml_moe_slot_table_new(16, 4);
    for (int32_t e = 0; e < 10; e++) {
        assign(a, {e, (e * 7) % 16});
    }
    CHECK(ggml_moe_slot_table_state_size(a) == 3 * 4 + 16 + 2);
    std::vector<int32_t> state(ggml_moe_slot_table_state_size(a));
    ggml_moe_slot_table_get_state(a, state.data());
    ggml_moe_slot_table_t b = ggml_moe_slot_table_new(16, 4);
    ggml_moe_slot_table_set_state(b, state.data());
    bool same = true;
    for (int32_t e = 0; e < 16; e++) {
        same = same && ggml_moe_slot_table_slot_of(a, e) == ggml_moe_slot_table_slot_of(b, e);
    }
    for (int32_t e = 3; e < 40; e++) {
        const result ra = assign(a, {e % 16, (e * 5 + 1) % 16});
        const result rb = assign(b, {e % 16, (e * 5 + 1) % 16});
        same = same && ra.slots == rb.slots && ra.loads == rb.loads;
    }
    CHECK(same);
    std::vector<int32_t> after_a(state.size()), after_b(state.size());
    ggml_moe_slot_table_get_state(a, after_a.data());
    ggml_moe_slot_table_get_state(b, after_b.data());
    CHECK(after_a == after_b && after_a != state);
    ggml_moe_slot_table_free(a);
    ggml_moe_slot_table_free(b);
    ggml_moe_slot_table_free(t);

    // recency: how many distinct experts were used since an expert's last use (the LRU stack distance)
    CHECK(ggml_moe_recency_new(0) == nullptr);
    ggml_moe_recency_t rec = ggml_moe_recency_new(16);
    CHECK(ggml_moe_recency_distance(rec, 3) == -1);          // never used
    CHECK(ggml_moe_recency_distance(rec, 99) == -1);         // out of range
    const int32_t b1[] = {3, 5};
    ggml_moe_recency_touch(rec, b1, 2);
    CHECK(ggml_moe_recency_distance(rec, 3) == 0 && ggml_moe_recency_distance(rec, 5) == 0);   // one batch: neither before the other
    const int32_t b2[] = {7, 8, 9};
    ggml_moe_recency_touch(rec, b2, 3);
    CHECK(ggml_moe_recency_distance(rec, 3) == 3);           // 7, 8, 9 since
    CHECK(ggml_moe_recency_distance(rec, 9) == 0);
    const int32_t b3[] = {5, 7};
    ggml_moe_recency_touch(rec, b3, 2);
    CHECK(ggml_moe_recency_distance(rec, 3) == 4);           // 5, 7, 8, 9: a repeat counts once
    CHECK(ggml_moe_recency_distance(rec, 8) == 2);           // 5, 7
    CHECK(ggml_moe_recency_distance(rec, 5) == 0);
    const int32_t bad[] = {-1, 16, 2};
    ggml_moe_recency_touch(rec, bad, 3);                     // out-of-range ids are ignored
    CHECK(ggml_moe_recency_distance(rec, 2) == 0 && ggml_moe_recency_distance(rec, 5) == 1);
    ggml_moe_recency_free(rec);

    std::printf("%d failed\n", failures);
    return failures == 0 ? 0 : 1;
}
