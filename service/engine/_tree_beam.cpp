// The tree route's beam search (service.engine.tree.TreeScorer.beam_leaves) as one compiled loop.
//
// Why native code: in numpy a level of the search is ~15 calls on arrays of a few hundred
// values, ~90 us a level on the team's machine, and a debian-deps query walks 16 levels (~0.85
// ms of a ~1.3 ms tree route); this loop does the same arithmetic in ~0.2 ms
// (bench/RESULTS.md, "The tree route's beam search in compiled code"). A JIT (numba) did as
// well but cost ~0.75 s at every process start, load check and CLI call.
//
// No numpy headers: arrays arrive as C-contiguous buffers whose dtypes and shapes the Python
// side fixes (TreeScorer._beam_arrays); sizes are checked here again before any read.
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
        Py_BEGIN_ALLOW_THREADS
        try {
            for (Py_ssize_t r = 0; r < batch; ++r) {
                const Query q{static_cast<const double*>(b[0].buf) + r * dim,
                              static_cast<const int64_t*>(b[5].buf) + r * tokens,
                              static_cast<const float*>(b[6].buf) + r * tokens, tokens};
                search_one(t, q, beam, static_cast<int64_t*>(b[8].buf) + r * beam,
                           static_cast<double*>(b[9].buf) + r * beam);
            }
        } catch (const std::bad_alloc&) {
            out_of_memory = true;
        }
        Py_END_ALLOW_THREADS
    }
    for (Py_buffer& buffer : b) PyBuffer_Release(&buffer);
    if (out_of_memory) return PyErr_NoMemory();
    if (bad != nullptr) {
        PyErr_SetString(PyExc_ValueError, bad);
        return nullptr;
    }
    Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"beam_search", beam_search, METH_VARARGS,
     "beam_search(z, weights, bias, table, half_value, offsets, token_weights, live, out_nodes, out_logp, "
     "batch, dim, tokens, depth, beam, table_kind): fill out_nodes/out_logp [batch, beam]"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "_tree_beam", "The tree route's beam search.", -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit__tree_beam(void) { return PyModule_Create(&module); }
