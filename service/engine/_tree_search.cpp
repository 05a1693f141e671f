// The tree route's search as compiled loops: the beam search down p_n's tree
// (service.engine.tree.TreeScorer.beam_leaves) and xi's lexical term of the beam's labels
// (service.engine.tree_lexical.LexicalRows.scores).
//
// Why native code: in numpy a level of the beam search is ~15 calls on arrays of a few hundred
// values, ~90 us a level on the team's machine, and a debian-deps query walks 16 levels (~0.85
// ms of a ~1.3 ms tree route); the lexical term's gather, unique and search took ~0.15 ms more.
// These loops do the same arithmetic in a fraction (bench/RESULTS.md, "The tree route's beam
// search in compiled code"). A JIT (numba) did as well but cost ~0.75 s at every process
// start, load check and CLI call.
//
// No numpy headers: arrays arrive as C-contiguous buffers whose dtypes and shapes the Python
// side fixes (TreeScorer.beam_leaves, LexicalRows.scores); sizes are checked here again before
// any read.
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

const char* check_sizes(const Py_buffer* b, Py_ssize_t batch, Py_ssize_t dim, Py_ssize_t tokens, Py_ssize_t depth,
                        Py_ssize_t beam, int table_kind) {
    // b: z, weights, bias, table, half_value, offsets, token_weights, live, out_nodes, out_logp
    if (batch < 0 || dim < 1 || tokens < 0 || depth < 0 || depth > 40 || beam < 1) return "bad sizes";
    const Py_ssize_t internal = (static_cast<Py_ssize_t>(1) << depth) - 1;
    if (b[0].len != batch * dim * 8) return "z: expected [batch, dim] float64";
    if (b[1].len < internal * dim * 4) return "node weights: fewer rows than the tree's internal nodes";
    if (b[2].len < internal * 8) return "node bias: fewer values than the tree's internal nodes";
    if (b[5].len != batch * tokens * 8 || b[6].len != batch * tokens * 4) return "tokens: expected [batch, T]";
    if (b[7].len != 0 && b[7].len < 2 * internal + 1) return "live: fewer values than the tree's nodes";
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
        Tree t{static_cast<const float*>(b[1].buf), static_cast<const double*>(b[2].buf),
               table_kind == 2 ? static_cast<const uint16_t*>(b[3].buf) : nullptr,
               static_cast<const float*>(b[4].buf),
               table_kind == 4 ? static_cast<const float*>(b[3].buf) : nullptr,
               static_cast<uint64_t>(b[3].len / (table_kind == 2 ? 2 : 4)) - 1,
               b[7].len != 0 ? static_cast<const uint8_t*>(b[7].buf) : nullptr, dim, depth};
        out_of_memory = !without_gil([&] {
            for (Py_ssize_t r = 0; r < batch; ++r) {
                const Query q{static_cast<const double*>(b[0].buf) + r * dim,
                              static_cast<const int64_t*>(b[5].buf) + r * tokens,
                              static_cast<const float*>(b[6].buf) + r * tokens, tokens};
                search_one(t, q, beam, static_cast<int64_t*>(b[8].buf) + r * beam,
                           static_cast<double*>(b[9].buf) + r * beam);
            }
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

PyMethodDef methods[] = {
    {"beam_search", beam_search, METH_VARARGS,
     "beam_search(z, weights, bias, table, half_value, offsets, token_weights, live, out_nodes, out_logp, "
     "batch, dim, tokens, depth, beam, table_kind): fill out_nodes/out_logp [batch, beam]"},
    {"lexical_scores", lexical_scores, METH_VARARGS,
     "lexical_scores(indptr, labels, weights, bias, ids, x, candidates, out, batch, tokens, count): "
     "fill out [batch, count]"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree_search", "The tree route's search loops.", -1, methods,
                      nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__tree_search(void) { return PyModule_Create(&module); }
