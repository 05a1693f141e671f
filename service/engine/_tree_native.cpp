// The tree route's compiled loops: the beam search down p_n's tree
// (service.engine.tree.TreeScorer.beam_leaves) and xi's lexical term of the beam's labels
// (service.engine.tree_lexical.LexicalRows.scores); and, for training, the ancestral sampling of
// xi's negatives from p_n (training/tree.py LabelTree.sample) and one Adagrad step of p_n's
// lexical node term (training/tree_node_lexical.py), which read the table's slots as the search
// does.
//
// Why native code: in numpy a level of the beam search is ~15 calls on arrays of a few hundred
// values, ~90 us a level on the team's machine, and a debian-deps query walks 16 levels (~0.85
// ms of a ~1.3 ms tree route); the lexical term's gather, unique and search took ~0.15 ms more.
// These loops do the same arithmetic in a fraction (bench/RESULTS.md, "The tree route's beam
// search in compiled code"). A JIT (numba) did as well but cost ~0.75 s at every process
// start, load check and CLI call.
//
// No numpy headers: arrays arrive as C-contiguous buffers whose dtypes and shapes the Python
// side fixes (TreeScorer.beam_leaves, sample_leaves, LexicalRows.scores, training's FitArrays);
// sizes are checked here again before any read.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <new>
#include <vector>

namespace {

struct Child {
    double logp;
    int64_t node;
};

struct Tree {
    const float* weights;     // [nodes, dim] each internal node's split on the projection
    const double* bias;       // [nodes] with the forced splits' +-inf folded in
    const uint16_t* half;     // node lexical table as float16 bits (table_kind 2), or null
    const float* half_value;  // [65536] float16 bits -> float32 (numpy's own conversion)
    const float* single;      // node lexical table as float32 (table_kind 4), or null
    uint64_t mask;            // table length - 1 (a power of two)
    const uint8_t* live;      // [2 * leaves - 1] may the beam enter the node, or null
    Py_ssize_t dim;
    Py_ssize_t depth;
};

struct Query {
    const double* z;          // [dim] the projected query
    const int64_t* offsets;   // [tokens] each token's first slot in the table
    const float* token_weights;  // [tokens] 0 = padding
    Py_ssize_t tokens;
};

double node_logit(const Tree& t, const Query& q, int64_t node) {
    const float* w = t.weights + node * t.dim;
    double s = 0.0;
    for (Py_ssize_t j = 0; j < t.dim; ++j) s += static_cast<double>(w[j]) * q.z[j];
    if (t.half != nullptr || t.single != nullptr) {
        double lexical = 0.0;
        for (Py_ssize_t i = 0; i < q.tokens; ++i) {
            const float x = q.token_weights[i];
            if (x == 0.0f) continue;
            const uint64_t slot = (static_cast<uint64_t>(node) + static_cast<uint64_t>(q.offsets[i])) & t.mask;
            const float v = t.half != nullptr ? t.half_value[t.half[slot]] : t.single[slot];
            lexical += static_cast<double>(v) * x;
        }
        s += lexical;
    }
    return s + t.bias[node];
}

// The beam's leaves for one query: heap nodes and path log-probs, at most `beam` of each.
void search_one(const Tree& t, const Query& q, Py_ssize_t beam, int64_t* out_nodes, double* out_logp) {
    std::vector<Child> kept{{0.0, 0}};
    std::vector<Child> children;
    children.reserve(2 * static_cast<size_t>(beam));
    for (Py_ssize_t level = 0; level < t.depth; ++level) {
        children.clear();
        for (const Child& parent : kept) {
            const double s = node_logit(t, q, parent.node);
            // log sigmoid(+-s) = min(+-s, 0) - log(1 + exp(-|s|)), exact at +-inf (forced splits).
            const double shared = std::log1p(std::exp(-std::fabs(s)));
            double left = parent.logp + std::min(s, 0.0) - shared;
            double right = parent.logp + std::min(-s, 0.0) - shared;
            if (std::isnan(left)) left = -INFINITY;
            if (std::isnan(right)) right = -INFINITY;
            const int64_t l = 2 * parent.node + 1;
            if (t.live != nullptr && !t.live[l]) left = -INFINITY;
            if (t.live != nullptr && !t.live[l + 1]) right = -INFINITY;
            children.push_back({left, l});
            children.push_back({right, l + 1});
        }
        if (static_cast<Py_ssize_t>(children.size()) > beam) {
            std::nth_element(children.begin(), children.begin() + beam, children.end(),
                             [](const Child& a, const Child& b) { return a.logp > b.logp; });
            children.resize(beam);
        }
        kept.swap(children);
    }
    Py_ssize_t i = 0;
    for (const Child& leaf : kept) {
        out_nodes[i] = leaf.node;
        out_logp[i] = leaf.logp;
        ++i;
    }
    for (; i < beam; ++i) {
        out_nodes[i] = -1;
        out_logp[i] = -INFINITY;
    }
}

// One query's ancestral samples y ~ p_n(.|x) (training's negatives, training/tree.py
// LabelTree.sample), level by level: from the root, a sample goes left when log(u) < log
// sigmoid(s_n(x)) for its uniform draw u at that level (log_draws[level * stride + i] = log(u)).
// Out: each sample's leaf (heap node) and its path's log-prob. A query's samples share the nodes
// near the root, so a node's two log-probs are computed once a level for all of them (up to
// kShared distinct nodes; past that each sample computes its own): a batch of 512 debian-tags
// documents x 8 samples in 1.8-2.0 ms, 2.9 ms with every sample computing its own.
constexpr size_t kShared = 32;

struct Split {
    int64_t node;
    double left, right;  // log sigmoid(s), log sigmoid(-s)
};

Split split_of(const Tree& t, const Query& q, int64_t node) {
    const double s = node_logit(t, q, node);
    const double shared = std::log1p(std::exp(-std::fabs(s)));
    return {node, std::min(s, 0.0) - shared, std::min(-s, 0.0) - shared};
}

void sample_query(const Tree& t, const Query& q, const double* log_draws, Py_ssize_t stride, Py_ssize_t samples,
                  int64_t* out_nodes, double* out_logp, std::vector<Split>& known) {
    std::fill(out_nodes, out_nodes + samples, 0);
    std::fill(out_logp, out_logp + samples, 0.0);
    for (Py_ssize_t level = 0; level < t.depth; ++level) {
        known.clear();
        for (Py_ssize_t i = 0; i < samples; ++i) {
            const int64_t node = out_nodes[i];
            auto hit = std::find_if(known.begin(), known.end(), [node](const Split& k) { return k.node == node; });
            const Split split = hit != known.end() ? *hit : split_of(t, q, node);
            if (hit == known.end() && known.size() < kShared) known.push_back(split);
            const bool go_left = log_draws[level * stride + i] < split.left;
            out_logp[i] += go_left ? split.left : split.right;
            out_nodes[i] = 2 * node + (go_left ? 1 : 2);
        }
    }
}

struct Rows {
    const int64_t* indptr;   // [vocab + 1] each token's run of (label, weight)
    const int32_t* labels;   // [nnz] ascending within a run
    const float* weights;    // [nnz] U[t, label]
    const float* bias;       // [num_labels] h
    Py_ssize_t vocab;
    Py_ssize_t num_labels;
};

// One query's term for its candidates: sum_t x_t U[t, y] + h_y for labels y on some known token's
// row (float32 products summed in the query's token order, then h_y added), 0 elsewhere. False
// when a token's run of U lies outside U.
bool lexical_one(const Rows& u, const int64_t* ids, const float* x, Py_ssize_t tokens, const int64_t* candidates,
                 Py_ssize_t count, double* out, std::vector<int64_t>& keys, std::vector<double>& sums) {
    size_t pairs = 0;
    for (Py_ssize_t i = 0; i < tokens; ++i) {
        if (ids[i] <= 0 || ids[i] >= u.vocab) continue;
        const int64_t start = u.indptr[ids[i]], end = u.indptr[ids[i] + 1];
        if (start < 0 || start > end || end > u.indptr[u.vocab]) return false;
        pairs += static_cast<size_t>(end - start);
    }
    int bits = 4;
    while ((static_cast<size_t>(1) << bits) < 2 * pairs) ++bits;
    const uint64_t mask = (static_cast<uint64_t>(1) << bits) - 1;
    keys.assign(mask + 1, -1);
    sums.assign(mask + 1, 0.0);
    auto slot_of = [&](int64_t label) {
        uint64_t slot = (static_cast<uint64_t>(label) * 0x9E3779B97F4A7C15ULL) >> (64 - bits);
        while (keys[slot] != -1 && keys[slot] != label) slot = (slot + 1) & mask;
        return slot;
    };
    for (Py_ssize_t i = 0; i < tokens; ++i) {
        if (ids[i] <= 0 || ids[i] >= u.vocab) continue;  // 0 pads a query's row
        for (int64_t s = u.indptr[ids[i]]; s < u.indptr[ids[i] + 1]; ++s) {
            const uint64_t slot = slot_of(u.labels[s]);
            keys[slot] = u.labels[s];
            sums[slot] += static_cast<double>(u.weights[s] * x[i]);  // a float32 product, as numpy's
        }
    }
    for (Py_ssize_t c = 0; c < count; ++c) {
        const int64_t label = candidates[c];
        out[c] = 0.0;
        if (label < 0 || label >= u.num_labels) continue;
        const uint64_t slot = slot_of(label);
        if (keys[slot] == label) out[c] = sums[slot] + static_cast<double>(u.bias[label]);
    }
    return true;
}

// b: z, weights, bias, table, half_value, offsets, token_weights, live (the search) or log_draws
// (the sampler: `draws`), out_nodes, out_logp; beam: the search's width or the samples per query.
const char* check_sizes(const Py_buffer* b, Py_ssize_t batch, Py_ssize_t dim, Py_ssize_t tokens, Py_ssize_t depth,
                        Py_ssize_t beam, int table_kind, bool draws = false) {
    if (batch < 0 || dim < 1 || tokens < 0 || depth < 0 || depth > 40 || beam < 1) return "bad sizes";
    const Py_ssize_t internal = (static_cast<Py_ssize_t>(1) << depth) - 1;
    if (b[0].len != batch * dim * 8) return "z: expected [batch, dim] float64";
    if (b[1].len < internal * dim * 4) return "node weights: fewer rows than the tree's internal nodes";
    if (b[2].len < internal * 8) return "node bias: fewer values than the tree's internal nodes";
    if (b[5].len != batch * tokens * 8 || b[6].len != batch * tokens * 4) return "tokens: expected [batch, T]";
    if (draws && b[7].len != depth * batch * beam * 8) return "log_draws: expected [depth, batch * samples] float64";
    if (!draws && b[7].len != 0 && b[7].len < 2 * internal + 1) return "live: fewer values than the tree's nodes";
    if (b[8].len != batch * beam * 8 || b[9].len != batch * beam * 8) return "outputs: expected [batch, beam]";
    const Py_ssize_t item = table_kind == 2 ? 2 : 4;
    const Py_ssize_t slots = b[3].len / item;
    if (table_kind == 0) return nullptr;
    if ((table_kind != 2 && table_kind != 4) || slots < 2 || (slots & (slots - 1)) != 0 || b[3].len % item != 0)
        return "table: expected a power-of-two length of float16 or float32";
    if (table_kind == 2 && b[4].len != 65536 * 4) return "half_value: expected 65536 float32";
    return nullptr;
}

// Runs f with the GIL released (the loops touch no Python object); false when it ran out of memory.
template <class F>
bool without_gil(F&& f) {
    bool ok = true;
    Py_BEGIN_ALLOW_THREADS
    try {
        f();
    } catch (const std::bad_alloc&) {
        ok = false;
    }
    Py_END_ALLOW_THREADS
    return ok;
}

// Releases a call's buffers and answers it: MemoryError, ValueError(bad) or None.
PyObject* finish(Py_buffer* b, int count, bool out_of_memory, const char* bad) {
    for (int i = 0; i < count; ++i) PyBuffer_Release(&b[i]);
    if (out_of_memory) return PyErr_NoMemory();
    if (bad != nullptr) {
        PyErr_SetString(PyExc_ValueError, bad);
        return nullptr;
    }
    Py_RETURN_NONE;
}

Tree tree_of(const Py_buffer* b, Py_ssize_t dim, Py_ssize_t depth, int table_kind, bool live) {
    return Tree{static_cast<const float*>(b[1].buf), static_cast<const double*>(b[2].buf),
                table_kind == 2 ? static_cast<const uint16_t*>(b[3].buf) : nullptr,
                static_cast<const float*>(b[4].buf),
                table_kind == 4 ? static_cast<const float*>(b[3].buf) : nullptr,
                static_cast<uint64_t>(b[3].len / (table_kind == 2 ? 2 : 4)) - 1,
                live && b[7].len != 0 ? static_cast<const uint8_t*>(b[7].buf) : nullptr, dim, depth};
}

Query query_of(const Py_buffer* b, Py_ssize_t row, Py_ssize_t dim, Py_ssize_t tokens) {
    return Query{static_cast<const double*>(b[0].buf) + row * dim, static_cast<const int64_t*>(b[5].buf) + row * tokens,
                 static_cast<const float*>(b[6].buf) + row * tokens, tokens};
}

PyObject* beam_search(PyObject*, PyObject* args) {
    Py_buffer b[10];
    Py_ssize_t batch, dim, tokens, depth, beam;
    int table_kind;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*w*w*nnnnni:beam_search", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5],
                          &b[6], &b[7], &b[8], &b[9], &batch, &dim, &tokens, &depth, &beam, &table_kind))
        return nullptr;
    const char* bad = check_sizes(b, batch, dim, tokens, depth, beam, table_kind);
    bool out_of_memory = false;
    if (bad == nullptr) {
        const Tree t = tree_of(b, dim, depth, table_kind, true);
        out_of_memory = !without_gil([&] {
            for (Py_ssize_t r = 0; r < batch; ++r)
                search_one(t, query_of(b, r, dim, tokens), beam, static_cast<int64_t*>(b[8].buf) + r * beam,
                           static_cast<double*>(b[9].buf) + r * beam);
        });
    }
    return finish(b, 10, out_of_memory, bad);
}

PyObject* ancestral_sample(PyObject*, PyObject* args) {
    Py_buffer b[10];
    Py_ssize_t batch, dim, tokens, depth, samples;
    int table_kind;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*w*w*nnnnni:ancestral_sample", &b[0], &b[1], &b[2], &b[3], &b[4],
                          &b[5], &b[6], &b[7], &b[8], &b[9], &batch, &dim, &tokens, &depth, &samples, &table_kind))
        return nullptr;
    const char* bad = check_sizes(b, batch, dim, tokens, depth, samples, table_kind, true);
    bool out_of_memory = false;
    if (bad == nullptr) {
        const Tree t = tree_of(b, dim, depth, table_kind, false);
        const double* log_draws = static_cast<const double*>(b[7].buf);
        out_of_memory = !without_gil([&] {
            std::vector<Split> known;
            known.reserve(kShared);
            for (Py_ssize_t r = 0; r < batch; ++r)
                sample_query(t, query_of(b, r, dim, tokens), log_draws + r * samples, batch * samples, samples,
                             static_cast<int64_t*>(b[8].buf) + r * samples,
                             static_cast<double*>(b[9].buf) + r * samples, known);
        });
    }
    return finish(b, 10, out_of_memory, bad);
}

PyObject* lexical_scores(PyObject*, PyObject* args) {
    // b: indptr, labels, weights, bias, ids, x, candidates, out
    Py_buffer b[8];
    Py_ssize_t batch, tokens, count;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*w*nnn:lexical_scores", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5], &b[6],
                          &b[7], &batch, &tokens, &count))
        return nullptr;
    const char* bad = nullptr;
    const Py_ssize_t vocab = b[0].len / 8 - 1;
    const int64_t* indptr = static_cast<const int64_t*>(b[0].buf);
    if (batch < 0 || tokens < 0 || count < 0 || vocab < 0 || b[0].len % 8 != 0)
        bad = "bad sizes";
    else if (indptr[0] != 0 || b[1].len != indptr[vocab] * 4 || b[2].len != indptr[vocab] * 4 || b[3].len % 4 != 0)
        bad = "rows: indptr, labels and weights disagree";
    else if (b[4].len != batch * tokens * 8 || b[5].len != batch * tokens * 4)
        bad = "tokens: expected [batch, T]";
    else if (b[6].len != batch * count * 8 || b[7].len != batch * count * 8)
        bad = "candidates, out: expected [batch, C]";
    bool out_of_memory = false;
    if (bad == nullptr) {
        const Rows u{indptr, static_cast<const int32_t*>(b[1].buf), static_cast<const float*>(b[2].buf),
                     static_cast<const float*>(b[3].buf), vocab, b[3].len / 4};
        out_of_memory = !without_gil([&] {
            std::vector<int64_t> keys;
            std::vector<double> sums;
            for (Py_ssize_t r = 0; r < batch && bad == nullptr; ++r)
                if (!lexical_one(u, static_cast<const int64_t*>(b[4].buf) + r * tokens,
                                 static_cast<const float*>(b[5].buf) + r * tokens, tokens,
                                 static_cast<const int64_t*>(b[6].buf) + r * count, count,
                                 static_cast<double*>(b[7].buf) + r * count, keys, sums))
                    bad = "rows: a token's run lies outside labels and weights";
        });
    }
    return finish(b, 8, out_of_memory, bad);
}

// --- training: one Adagrad step of p_n's lexical node term (training/tree_node_lexical.py) ---
//
// The same slot(n, t) and s_n(x) as node_logit above, fitted: for each document of the batch,
// each node on its positive labels' paths is one row weighted by how many of its pairs go left
// and right; the loss is softplus(-d s) per pair plus l2 v^2 per (pair, word); every slot's
// gradient is summed over the batch before its Adagrad update (all rows read the table as it
// was before the step). In numpy this step was ~15 gathers, two sorts and bincounts on a few
// 10^5 values: 8.9 s of debian-tags' 30-epoch fit, 63 s of debian-deps'; here a loop over the
// batch's rows, 2.1-2.6 s and 12-16 s, the same table (bench/RESULTS.md).

struct NodeLexicalData {
    const int64_t* doc_start;    // [docs + 1] each document's run of positive pairs
    const int64_t* pair_label;   // [pairs]
    const int64_t* path_nodes;   // [labels, depth] heap nodes from the root
    const double* path_signs;    // [labels, depth] +1 left, -1 right
    const float* node_weights;   // [nodes, dim]
    const double* bias;          // [nodes] with the forced splits' +-inf folded in (those rows skipped)
    const float* z;              // [docs, dim]
    const int64_t* word_start;   // [docs + 1] each document's run of words
    const int64_t* word_offsets; // [words] each word's first slot
    const double* word_weights;  // [words]
    Py_ssize_t docs, pairs, labels, nodes, words, dim, depth;
};

// One slot of the fit: its value, Adagrad's sum of squared gradients and the batch's gradient in
// one 16-byte record, so that a slot's three reads (scoring, gradient, update) are one cache
// miss, not three: the table (2^22 slots by default) is far larger than a core's caches. With
// the prefetches below, the misses no longer bound the step (2^14 slots train no faster).
struct Slot {
    float value;
    float sum_sq;
    double grad;  // zero between steps
};
static_assert(sizeof(Slot) == 16, "a slot is four float32 columns of the Python side's state");

struct NodeLexicalState {
    Slot* slots;
    uint64_t mask;   // slots - 1
    double* counts;  // [nodes, 2] zero between steps (a buffer of the fit's, not one a step: 32 MB at 10^6 labels)
};

// softplus(-s), softplus(s), sigmoid(s), sigmoid(-s) from one exp and one log1p.
struct Logistic {
    double softplus_neg, softplus_pos, sigmoid_pos, sigmoid_neg;
    explicit Logistic(double s) {
        const double e = std::exp(-std::fabs(s)), shared = std::log1p(e);
        softplus_neg = std::max(-s, 0.0) + shared;
        softplus_pos = std::max(s, 0.0) + shared;
        const double small = e / (1.0 + e);  // sigmoid(-|s|)
        sigmoid_pos = s >= 0 ? 1.0 - small : small;
        sigmoid_neg = s >= 0 ? small : 1.0 - small;
    }
};

// One document's rows: their loss, their gradients summed into the slots' grad (slots listed in
// touched). False when an index lies outside its array.
bool document_rows(const NodeLexicalData& a, const NodeLexicalState& st, int64_t doc, double l2,
                   std::vector<int64_t>& nodes, std::vector<uint64_t>& touched, double& loss) {
    if (doc < 0 || doc >= a.docs) return false;
    const int64_t p0 = a.doc_start[doc], p1 = a.doc_start[doc + 1];
    const int64_t w0 = a.word_start[doc], w1 = a.word_start[doc + 1];
    if (p0 < 0 || p0 > p1 || p1 > a.pairs || w0 < 0 || w0 > w1 || w1 > a.words) return false;
    nodes.clear();
    double* counts = st.counts;  // [nodes, 2]: pairs going left, right
    for (int64_t p = p0; p < p1; ++p) {
        const int64_t label = a.pair_label[p];
        bool inside = label >= 0 && label < a.labels;
        const int64_t* path = inside ? a.path_nodes + label * a.depth : nullptr;
        for (Py_ssize_t j = 0; inside && j < a.depth; ++j) inside = path[j] >= 0 && path[j] < a.nodes;
        if (!inside) {
            for (const int64_t n : nodes) counts[2 * n] = counts[2 * n + 1] = 0.0;  // left zero for the next step
            return false;
        }
        for (Py_ssize_t j = 0; j < a.depth; ++j) {
            const int64_t n = path[j];
            if (counts[2 * n] == 0.0 && counts[2 * n + 1] == 0.0) nodes.push_back(n);
            counts[2 * n + (a.path_signs[label * a.depth + j] > 0 ? 0 : 1)] += 1.0;
        }
    }
    // The rows' slots are scattered over a table larger than the caches: ask for all of them
    // before the first is read, so that their misses overlap.
    for (const int64_t n : nodes)
        for (int64_t w = w0; w < w1; ++w)
            __builtin_prefetch(&st.slots[(static_cast<uint64_t>(n) + a.word_offsets[w]) & st.mask], 1);
    for (const int64_t n : nodes) {
        const double go_left = counts[2 * n], go_right = counts[2 * n + 1], count = go_left + go_right;
        counts[2 * n] = counts[2 * n + 1] = 0.0;
        if (!std::isfinite(a.bias[n])) continue;  // a forced split has nothing to learn
        double dense = 0.0;
        for (Py_ssize_t k = 0; k < a.dim; ++k)
            dense += static_cast<double>(a.node_weights[n * a.dim + k]) * static_cast<double>(a.z[doc * a.dim + k]);
        double lexical = 0.0;
        for (int64_t w = w0; w < w1; ++w)
            lexical += static_cast<double>(st.slots[(static_cast<uint64_t>(n) + a.word_offsets[w]) & st.mask].value) *
                       a.word_weights[w];
        const Logistic f(dense + a.bias[n] + lexical);
        loss += go_left * f.softplus_neg + go_right * f.softplus_pos;
        const double d_s = go_right * f.sigmoid_pos - go_left * f.sigmoid_neg;
        for (int64_t w = w0; w < w1; ++w) {
            const uint64_t at = (static_cast<uint64_t>(n) + a.word_offsets[w]) & st.mask;
            Slot& slot = st.slots[at];
            const double v = slot.value;
            loss += l2 * count * v * v;
            if (slot.grad == 0.0) touched.push_back(at);  // listed again if it returns to 0: harmless
            slot.grad += d_s * a.word_weights[w] + 2.0 * l2 * count * v;
        }
    }
    return true;
}

// Adagrad on the slots the batch touched: sum_sq and the step in float32 (as the numpy fit
// before this one did it).
void apply_adagrad(const NodeLexicalState& st, const std::vector<uint64_t>& touched, double lr) {
    constexpr size_t ahead = 16;  // slots asked for before they are updated: their misses overlap
    for (size_t i = 0; i < touched.size(); ++i) {
        if (i + ahead < touched.size()) __builtin_prefetch(&st.slots[touched[i + ahead]], 1);
        Slot& slot = st.slots[touched[i]];
        const double g = slot.grad;
        slot.grad = 0.0;
        slot.sum_sq = static_cast<float>(slot.sum_sq + g * g);
        const float root = std::sqrt(slot.sum_sq) + 1e-10f;
        slot.value -= static_cast<float>(lr * g / root);
    }
}

const char* check_node_lexical(const Py_buffer* b, Py_ssize_t dim, Py_ssize_t depth, NodeLexicalData& a) {
    // b: batch, doc_start, pair_label, path_nodes, path_signs, node_weights, bias, z, word_start,
    //    word_offsets, word_weights, state, node counts
    if (dim < 1 || depth < 0 || depth > 40) return "bad sizes";
    for (int i : {0, 1, 2, 3, 4, 6, 8, 9, 10})
        if (b[i].len % 8 != 0) return "expected 8-byte items";
    a.docs = b[1].len / 8 - 1;
    a.pairs = b[2].len / 8;
    a.labels = depth == 0 ? 0 : b[3].len / 8 / depth;
    a.nodes = b[6].len / 8;
    a.words = b[9].len / 8;
    if (a.docs < 0 || b[8].len != b[1].len) return "doc_start, word_start: expected [docs + 1]";
    if (b[3].len != a.labels * depth * 8 || b[4].len != b[3].len) return "paths: expected [labels, depth]";
    if (b[5].len != a.nodes * dim * 4) return "node weights: expected [nodes, dim] float32";
    if (b[7].len != a.docs * dim * 4) return "z: expected [docs, dim] float32";
    if (b[10].len != b[9].len) return "words: offsets and weights disagree";
    const Py_ssize_t slots = b[11].len / static_cast<Py_ssize_t>(sizeof(Slot));
    if (slots < 2 || (slots & (slots - 1)) != 0 || b[11].len % static_cast<Py_ssize_t>(sizeof(Slot)) != 0)
        return "state: expected [slots, 4] float32, slots a power of two";
    if (b[12].len != a.nodes * 16) return "node counts: expected [nodes, 2] float64";
    a.dim = dim;
    a.depth = depth;
    return nullptr;
}

PyObject* node_lexical_step(PyObject*, PyObject* args) {
    Py_buffer b[13];
    Py_ssize_t dim, depth;
    double lr, l2;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*y*y*y*y*y*y*w*w*nndd:node_lexical_step", &b[0], &b[1], &b[2], &b[3],
                          &b[4], &b[5], &b[6], &b[7], &b[8], &b[9], &b[10], &b[11], &b[12], &dim, &depth, &lr, &l2))
        return nullptr;
    NodeLexicalData a{};
    const char* bad = check_node_lexical(b, dim, depth, a);
    double loss = 0.0;
    bool out_of_memory = false;
    if (bad == nullptr) {
        a.doc_start = static_cast<const int64_t*>(b[1].buf);
        a.pair_label = static_cast<const int64_t*>(b[2].buf);
        a.path_nodes = static_cast<const int64_t*>(b[3].buf);
        a.path_signs = static_cast<const double*>(b[4].buf);
        a.node_weights = static_cast<const float*>(b[5].buf);
        a.bias = static_cast<const double*>(b[6].buf);
        a.z = static_cast<const float*>(b[7].buf);
        a.word_start = static_cast<const int64_t*>(b[8].buf);
        a.word_offsets = static_cast<const int64_t*>(b[9].buf);
        a.word_weights = static_cast<const double*>(b[10].buf);
        const NodeLexicalState st{static_cast<Slot*>(b[11].buf), static_cast<uint64_t>(b[11].len / sizeof(Slot)) - 1,
                                  static_cast<double*>(b[12].buf)};
        const int64_t* batch = static_cast<const int64_t*>(b[0].buf);
        out_of_memory = !without_gil([&] {
            std::vector<int64_t> nodes;
            std::vector<uint64_t> touched;
            for (Py_ssize_t i = 0; i < b[0].len / 8 && bad == nullptr; ++i)
                if (!document_rows(a, st, batch[i], l2, nodes, touched, loss))
                    bad = "an index lies outside its array";
            if (bad == nullptr) {
                apply_adagrad(st, touched, lr);
            } else {
                for (const uint64_t at : touched) st.slots[at].grad = 0.0;  // grad stays zero between steps
            }
        });
    }
    if (out_of_memory || bad != nullptr) return finish(b, 13, out_of_memory, bad);
    for (auto& buffer : b) PyBuffer_Release(&buffer);
    return PyFloat_FromDouble(loss);
}

PyMethodDef methods[] = {
    {"beam_search", beam_search, METH_VARARGS,
     "beam_search(z, weights, bias, table, half_value, offsets, token_weights, live, out_nodes, out_logp, "
     "batch, dim, tokens, depth, beam, table_kind): fill out_nodes/out_logp [batch, beam]"},
    {"ancestral_sample", ancestral_sample, METH_VARARGS,
     "ancestral_sample(z, weights, bias, table, half_value, offsets, token_weights, log_draws, out_nodes, "
     "out_logp, batch, dim, tokens, depth, samples, table_kind): fill out_nodes/out_logp [batch, samples] with "
     "leaves drawn from p_n, log_draws [depth, batch * samples] the logs of uniforms in (0, 1)"},
    {"lexical_scores", lexical_scores, METH_VARARGS,
     "lexical_scores(indptr, labels, weights, bias, ids, x, candidates, out, batch, tokens, count): "
     "fill out [batch, count]"},
    {"node_lexical_step", node_lexical_step, METH_VARARGS,
     "node_lexical_step(batch, doc_start, pair_label, path_nodes, path_signs, node_weights, bias, z, word_start, "
     "word_offsets, word_weights, state, node_counts, dim, depth, lr, l2): one Adagrad step on state "
     "[slots, 4] float32 (value, sum_sq, grad's float64) in place, node_counts [nodes, 2] float64 zero "
     "before and after; the loss"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree_native",
                      "The tree's compiled loops: its search, its sampling, its node term's fit.", -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__tree_native(void) { return PyModule_Create(&module); }
