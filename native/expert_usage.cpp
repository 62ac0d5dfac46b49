// expert_usage: which routed experts a MoE model's router picks, read through llama.cpp itself.
//
// Loads a GGUF, evaluates prompts of random token ids (one fresh context state per prompt) and captures the
// router's top-k output of every MoE layer (the graph tensors named "ffn_moe_topk-<layer>") with the
// scheduler's eval callback. Prints one JSON object on stdout:
//
//   {"model": ..., "arch": ..., "n_expert": 128, "n_expert_used": 8, "n_layer": 48,
//    "runs": [{"n_tokens": 512, "layers": [{"layer": 0, "distinct": 125, "max_share": 0.03,
//                                            "counts": [..n_expert..]}, ...]}, ...]}
//
// "distinct" is the number of experts chosen at least once by any token of the prompt; "max_share" the
// largest fraction of (token, slot) picks that went to a single expert.
//
// usage: expert_usage MODEL.gguf [-n TOKENS]... [--seed S] [-t THREADS] [-ngl N]
//        expert_usage MODEL.gguf --trace OUT.trace [--decode N] [--prompts FILE] [--sample T] [--seed S] [-t T]
//                     [-ngl N]
//   -n        prompt length (repeatable; default: 512 and 8)
//   --seed    seed of the random token ids (default 1)
//   -t        CPU threads (default: all)
//   -ngl      layers to offload to a GPU (default 0)
//   --trace   decode-order routing trace instead of the usage summary: N tokens (--decode, default 1024) are
//             evaluated ONE PER llama_decode call, as generation runs them, and the experts every token picks
//             in every MoE layer are written to OUT.trace (via OUT.trace.part, renamed when complete). The
//             tokens are the text of --prompts FILE (tokenized by the model, fed as they stand: a real text
//             does not loop), else uniformly random token ids (independent: the stream never repeats a
//             pattern, so any locality in the trace comes from the model). --sample T: after the text (or one
//             random token), the tokens are sampled from the model at temperature T (seeded by --seed), as
//             a server generates them; never greedy (a random-weight model's greedy output loops). A summary
//             line goes to stdout.
//
// Trace format (little-endian):
//   offset 0   8 bytes   magic "EXPTRACE"
//          8   u32       version (1)
//         12   u32       n_expert
//         16   u32       n_expert_used (k)
//         20   u32       n_layers: MoE layers traced
//         24   u32       n_tokens
//         28   u32       reserved (0)
//         32   i32[n_layers]                          model layer index of each traced layer, ascending
//         ..   u16[n_tokens][n_layers][k]             expert ids: token-major (decode order), then layer, then
//                                                     the router's top-k order
//
// Built on demand by orchestrator/model/routing.py against the static llama.cpp libraries that
// `orchestrator build` keeps in its cache.

#include "llama.h"
#include "ggml.h"
#include "ggml-backend.h"

#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

struct capture {
    int n_expert = 0;
    bool trace = false;                             // keep the ids of each layer's picks (one token per decode)
    std::map<int, std::vector<int64_t>> counts;   // layer -> picks per expert
    std::map<int, std::vector<int32_t>> picks;    // layer -> expert ids of the current decode, router order
    std::string error;
};

const char * PREFIX = "ffn_moe_topk-";

bool on_tensor(struct ggml_tensor * t, bool ask, void * user_data) {
    auto * cap = static_cast<capture *>(user_data);
    if (std::strncmp(t->name, PREFIX, std::strlen(PREFIX)) != 0) {
        return !ask;   // ask: not needed; after compute: keep going
    }
    if (ask) {
        return true;
    }
    if (t->type != GGML_TYPE_I32) {
        cap->error = std::string(t->name) + ": expected an I32 tensor";
        return false;
    }
    const int layer = std::atoi(t->name + std::strlen(PREFIX));
    const size_t nbytes = ggml_nbytes(t);
    std::vector<uint8_t> buf(nbytes);
    ggml_backend_tensor_get(t, buf.data(), 0, nbytes);   // a strided view: read its whole span
    auto & counts = cap->counts[layer];
    if (counts.empty()) {
        counts.assign(cap->n_expert, 0);
    }
    auto & picks = cap->picks[layer];
    for (int64_t i3 = 0; i3 < t->ne[3]; i3++) {
        for (int64_t i2 = 0; i2 < t->ne[2]; i2++) {
            for (int64_t i1 = 0; i1 < t->ne[1]; i1++) {
                for (int64_t i0 = 0; i0 < t->ne[0]; i0++) {
                    const size_t off = i0 * t->nb[0] + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3];
                    int32_t e;
                    std::memcpy(&e, buf.data() + off, sizeof(e));
                    if (e < 0 || e >= cap->n_expert) {
                        cap->error = std::string(t->name) + ": expert id " + std::to_string(e) + " out of range";
                        return false;
                    }
                    counts[e]++;
                    if (cap->trace) {
                        picks.push_back(e);
                    }
                }
            }
        }
    }
    return true;
}

void quiet_log(enum ggml_log_level level, const char * text, void *) {
    if (level == GGML_LOG_LEVEL_ERROR) {
        std::fputs(text, stderr);
    }
}

std::string meta(const llama_model * model, const std::string & key) {
    char buf[256];
    const int n = llama_model_meta_val_str(model, key.c_str(), buf, sizeof(buf));
    return n < 0 ? std::string() : std::string(buf);
}

std::string json_escape(const std::string & s) {
    std::string out;
    for (char c : s) {
        if (c == '"' || c == '\\') {
            out += '\\';
            out += c;
        } else if (static_cast<unsigned char>(c) < 0x20) {
            char tmp[8];
            std::snprintf(tmp, sizeof(tmp), "\\u%04x", c);
            out += tmp;
        } else {
            out += c;
        }
    }
    return out;
}

int usage(const char * argv0) {
    std::fprintf(stderr, "usage: %s MODEL.gguf [-n TOKENS]... [--seed S] [-t THREADS] [-ngl N]\n"
                         "       %s MODEL.gguf --trace OUT [--decode N] [--prompts FILE] [--sample T] [--seed S] [-t T] [-ngl N]\n",
                 argv0, argv0);
    return 2;
}

bool read_file(const std::string & path, std::string & out) {
    FILE * f = std::fopen(path.c_str(), "rb");
    if (!f) {
        return false;
    }
    char buf[65536];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) {
        out.append(buf, n);
    }
    const bool ok = !std::ferror(f);
    std::fclose(f);
    return ok;
}

void put_u32(std::string & out, uint32_t v) {
    for (int i = 0; i < 4; i++) {
        out.push_back((char) ((v >> (8 * i)) & 0xff));
    }
}

// Sample a token from the last logits at `temperature` (softmax over the whole vocabulary).
llama_token sample_token(llama_context * ctx, int n_vocab, float temperature, std::mt19937 & rng) {
    const float * logits = llama_get_logits_ith(ctx, -1);
    float top = logits[0];
    for (int v = 1; v < n_vocab; v++) {
        top = logits[v] > top ? logits[v] : top;
    }
    std::vector<double> w(n_vocab);
    for (int v = 0; v < n_vocab; v++) {
        w[v] = std::exp((double) (logits[v] - top) / temperature);
    }
    std::discrete_distribution<int> pick(w.begin(), w.end());
    return (llama_token) pick(rng);
}

// Decode `n_total` tokens one per llama_decode -- `prefix` first, then (temperature > 0) tokens sampled from
// the model -- and write the trace described at the top of this file.
int run_trace(llama_context * ctx, capture & cap, std::vector<llama_token> tokens, int n_total, int n_used,
              int n_vocab, float temperature, unsigned seed, const std::string & out_path) {
    std::mt19937 srng(seed ^ 0x5eed5eedu);
    cap.trace = true;
    std::vector<int32_t> layers;
    std::vector<uint16_t> ids;
    llama_memory_clear(llama_get_memory(ctx), true);
    llama_batch batch = llama_batch_init(1, 0, 1);
    for (size_t i = 0; i < (size_t) n_total; i++) {
        cap.picks.clear();
        batch.token[0] = tokens[i];
        batch.pos[0] = (llama_pos) i;
        batch.n_seq_id[0] = 1;
        batch.seq_id[0][0] = 0;
        batch.logits[0] = 1;
        batch.n_tokens = 1;
        const int rc = llama_decode(ctx, batch);
        if (rc != 0 || !cap.error.empty()) {
            std::fprintf(stderr, "expert_usage: decode of token %zu failed (%d) %s\n", i, rc, cap.error.c_str());
            llama_batch_free(batch);
            return 1;
        }
        if (cap.picks.empty()) {
            std::fprintf(stderr, "expert_usage: no ffn_moe_topk tensors seen: this llama.cpp names them differently\n");
            llama_batch_free(batch);
            return 1;
        }
        if (layers.empty()) {
            for (const auto & kv : cap.picks) {
                layers.push_back(kv.first);
            }
        }
        if (cap.picks.size() != layers.size()) {
            std::fprintf(stderr, "expert_usage: token %zu routed in %zu layers, token 0 in %zu\n", i,
                         cap.picks.size(), layers.size());
            llama_batch_free(batch);
            return 1;
        }
        for (const auto & kv : cap.picks) {
            if ((int) kv.second.size() != n_used) {
                std::fprintf(stderr, "expert_usage: layer %d picked %zu experts for one token, expected %d\n",
                             kv.first, kv.second.size(), n_used);
                llama_batch_free(batch);
                return 1;
            }
            for (int32_t e : kv.second) {
                ids.push_back((uint16_t) e);
            }
        }
        if (i + 1 >= tokens.size() && i + 1 < (size_t) n_total) {
            tokens.push_back(sample_token(ctx, n_vocab, temperature, srng));
        }
    }
    llama_batch_free(batch);

    std::string head = "EXPTRACE";
    put_u32(head, 1);
    put_u32(head, (uint32_t) cap.n_expert);
    put_u32(head, (uint32_t) n_used);
    put_u32(head, (uint32_t) layers.size());
    put_u32(head, (uint32_t) n_total);
    put_u32(head, 0);
    for (int32_t l : layers) {
        put_u32(head, (uint32_t) l);
    }
    std::string body;
    body.reserve(ids.size() * 2);
    for (uint16_t e : ids) {
        body.push_back((char) (e & 0xff));
        body.push_back((char) (e >> 8));
    }
    const std::string part = out_path + ".part";
    FILE * f = std::fopen(part.c_str(), "wb");
    bool ok = f != nullptr;
    if (ok) {
        ok = std::fwrite(head.data(), 1, head.size(), f) == head.size() &&
             std::fwrite(body.data(), 1, body.size(), f) == body.size();
        ok = (std::fclose(f) == 0) && ok;
    }
    if (!ok || std::rename(part.c_str(), out_path.c_str()) != 0) {
        std::remove(part.c_str());
        std::fprintf(stderr, "expert_usage: %s: cannot write the trace: %s\n", out_path.c_str(), std::strerror(errno));
        return 1;
    }
    std::printf("{\"trace\": \"%s\", \"n_tokens\": %d, \"n_layers\": %zu, \"n_expert\": %d, \"n_expert_used\": %d}\n",
                json_escape(out_path).c_str(), n_total, layers.size(), cap.n_expert, n_used);
    return 0;
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 2) {
        return usage(argv[0]);
    }
    std::string path;
    std::vector<int> lengths;
    unsigned seed = 1;
    int threads = (int) std::thread::hardware_concurrency();
    int ngl = 0;
    std::string trace_path;
    std::string prompts_path;
    int n_decode = 1024;
    float temperature = 0.0f;
    for (int i = 1; i < argc; i++) {
        const std::string a = argv[i];
        auto next = [&](void) -> const char * {
            if (i + 1 >= argc) {
                std::fprintf(stderr, "expert_usage: %s needs a value\n", a.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        if (a == "-n") {
            lengths.push_back(std::atoi(next()));
        } else if (a == "--seed") {
            seed = (unsigned) std::strtoul(next(), nullptr, 10);
        } else if (a == "-t") {
            threads = std::atoi(next());
        } else if (a == "-ngl") {
            ngl = std::atoi(next());
        } else if (a == "--trace") {
            trace_path = next();
        } else if (a == "--decode") {
            n_decode = std::atoi(next());
        } else if (a == "--prompts") {
            prompts_path = next();
        } else if (a == "--sample") {
            temperature = std::strtof(next(), nullptr);
            if (!(temperature > 0.0f)) {
                std::fprintf(stderr, "expert_usage: --sample needs a temperature > 0\n");
                return 2;
            }
        } else if (a == "-h" || a == "--help") {
            return usage(argv[0]);
        } else if (path.empty() && a[0] != '-') {
            path = a;
        } else {
            std::fprintf(stderr, "expert_usage: unknown argument %s\n", a.c_str());
            return usage(argv[0]);
        }
    }
    if (path.empty()) {
        return usage(argv[0]);
    }
    if (lengths.empty()) {
        lengths = {512, 8};
    }
    int max_len = 0;
    for (int n : lengths) {
        if (n < 1) {
            std::fprintf(stderr, "expert_usage: -n must be positive\n");
            return 2;
        }
        max_len = n > max_len ? n : max_len;
    }
    if (threads < 1) {
        threads = 1;
    }
    if (!trace_path.empty()) {
        if (n_decode < 1) {
            std::fprintf(stderr, "expert_usage: --decode must be positive\n");
            return 2;
        }
        max_len = n_decode;
    }
    std::string prompt_text;
    if (!prompts_path.empty() && !read_file(prompts_path, prompt_text)) {
        std::fprintf(stderr, "expert_usage: %s: cannot read the prompts file\n", prompts_path.c_str());
        return 2;
    }

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();

    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = ngl;
    // Routing is what is measured, not speed: without the repacked copy of the CPU weights, they are read from
    // the mapped file, so a model larger than host memory can still be traced.
    mp.use_extra_bufts = false;
    llama_model * model = llama_model_load_from_file(path.c_str(), mp);
    if (!model) {
        std::fprintf(stderr, "expert_usage: %s: failed to load the model\n", path.c_str());
        return 1;
    }
    const std::string arch = meta(model, "general.architecture");
    const int n_expert = std::atoi(meta(model, arch + ".expert_count").c_str());
    const int n_used = std::atoi(meta(model, arch + ".expert_used_count").c_str());
    if (n_expert <= 0) {
        std::fprintf(stderr, "expert_usage: %s: not a MoE model (no %s.expert_count)\n", path.c_str(), arch.c_str());
        llama_model_free(model);
        return 1;
    }

    capture cap;
    cap.n_expert = n_expert;

    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t) max_len + 16;
    // a trace decodes one token at a time: no need for the compute buffers of a long batch
    cp.n_batch = (uint32_t) (trace_path.empty() ? max_len : 32);
    cp.n_ubatch = cp.n_batch;
    cp.n_seq_max = 1;
    cp.n_threads = threads;
    cp.n_threads_batch = threads;
    cp.cb_eval = on_tensor;
    cp.cb_eval_user_data = &cap;
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        std::fprintf(stderr, "expert_usage: %s: failed to create a context\n", path.c_str());
        llama_model_free(model);
        return 1;
    }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    if (!trace_path.empty()) {
        std::vector<llama_token> tokens;
        if (!prompts_path.empty()) {
            std::vector<llama_token> all(prompt_text.size() + 16);
            int n = llama_tokenize(vocab, prompt_text.data(), (int32_t) prompt_text.size(), all.data(),
                                   (int32_t) all.size(), false, false);
            if (n < 0) {
                all.resize(-n);
                n = llama_tokenize(vocab, prompt_text.data(), (int32_t) prompt_text.size(), all.data(),
                                   (int32_t) all.size(), false, false);
            }
            if (n < 2) {
                std::fprintf(stderr, "expert_usage: %s: fewer than 2 tokens of text\n", prompts_path.c_str());
                llama_free(ctx);
                llama_model_free(model);
                return 2;
            }
            all.resize(n < n_decode ? n : n_decode);
            tokens = all;
        } else {
            std::mt19937 trng(seed);
            std::uniform_int_distribution<int> tpick(0, n_vocab - 1);
            tokens.resize(temperature > 0.0f ? 1 : n_decode);
            for (auto & t : tokens) {
                t = tpick(trng);
            }
        }
        const int n_total = temperature > 0.0f ? n_decode : (int) tokens.size();
        const int rc = run_trace(ctx, cap, tokens, n_total, n_used, n_vocab, temperature, seed, trace_path);
        llama_free(ctx);
        llama_model_free(model);
        llama_backend_free();
        return rc;
    }

    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> pick(0, n_vocab - 1);
    std::string out = "{\"model\": \"" + json_escape(path) + "\", \"arch\": \"" + json_escape(arch) +
                      "\", \"n_expert\": " + std::to_string(n_expert) + ", \"n_expert_used\": " +
                      std::to_string(n_used) + ", \"n_layer\": " + std::to_string(llama_model_n_layer(model)) +
                      ", \"seed\": " + std::to_string(seed) + ", \"runs\": [";
    int status = 0;
    for (size_t r = 0; r < lengths.size(); r++) {
        const int n = lengths[r];
        std::vector<llama_token> tokens(n);
        for (auto & t : tokens) {
            t = pick(rng);
        }
        cap.counts.clear();
        llama_memory_clear(llama_get_memory(ctx), true);
        // every token is an output, so the last layer routes all of them too (llama.cpp drops the rows it
        // does not need to output before the last layer's FFN)
        llama_batch batch = llama_batch_init(n, 0, 1);
        for (int i = 0; i < n; i++) {
            batch.token[i] = tokens[i];
            batch.pos[i] = i;
            batch.n_seq_id[i] = 1;
            batch.seq_id[i][0] = 0;
            batch.logits[i] = 1;
        }
        batch.n_tokens = n;
        const int rc = llama_decode(ctx, batch);
        llama_batch_free(batch);
        if (rc != 0 || !cap.error.empty()) {
            std::fprintf(stderr, "expert_usage: decode of %d tokens failed (%d) %s\n", n, rc, cap.error.c_str());
            status = 1;
            break;
        }
        if (cap.counts.empty()) {
            std::fprintf(stderr, "expert_usage: no ffn_moe_topk tensors seen: this llama.cpp names them differently\n");
            status = 1;
            break;
        }
        out += r ? ", " : "";
        out += "{\"n_tokens\": " + std::to_string(n) + ", \"layers\": [";
        bool first = true;
        for (const auto & [layer, counts] : cap.counts) {
            int64_t total = 0, top = 0;
            int distinct = 0;
            for (int64_t c : counts) {
                total += c;
                top = c > top ? c : top;
                distinct += c > 0;
            }
            char share[32];
            std::snprintf(share, sizeof(share), "%.4f", total ? (double) top / (double) total : 0.0);
            out += first ? "" : ", ";
            first = false;
            out += "{\"layer\": " + std::to_string(layer) + ", \"distinct\": " + std::to_string(distinct) +
                   ", \"max_share\": " + share + ", \"counts\": [";
            for (size_t e = 0; e < counts.size(); e++) {
                out += (e ? "," : "") + std::to_string(counts[e]);
            }
            out += "]}";
        }
        out += "]}";
    }
    out += "]}\n";
    if (status == 0) {
        std::fputs(out.c_str(), stdout);
    }
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return status;
}
