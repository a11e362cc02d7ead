// Host tables of one fused GEMM2 + GatherRS call: the C++ twin of `direct_layout_numpy`
// (megatron_overlap/ops/triton_gemm2_gatherrs.py, whose module docstring describes the row
// layout). Same values, same segment order, same int32 overflow check; O(L x R + R x E + TP x E).
// Also the flag-on dispatcher's sort-by-local-expert index (`local_expert_sort_index`, twin:
// megatron_overlap.megatron.dispatcher.local_expert_sort_index_numpy).
// Built as megatron_overlap.ops._layout by setup.py.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using Counts = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

[[noreturn]] void fail(const std::string& msg) { throw py::value_error(msg); }

std::string shape_of(const Counts& a) {
  std::string s = "(";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    s += std::to_string(a.shape(i)) + (a.ndim() == 1 ? "," : i + 1 < a.ndim() ? ", " : "");
  }
  return s + ")";
}

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }  // a >= 0, b > 0

// An integer array as int64; floats and other kinds are refused (forcecast would truncate).
Counts integer_counts(const py::array& a, const char* name) {
  const char kind = a.dtype().kind();
  if (kind != 'i' && kind != 'u') {
    fail(std::string(name) + " must be an integer array, got dtype " +
         std::string(py::str(a.dtype())));
  }
  return Counts::ensure(a);
}

// The scalars of one call's layout (see DirectLayout).
struct LayoutScalars {
  int64_t num_remote = 0, num_local = 0, col_blocks = 0, local_rows = 0, num_pairs = 0;
  int64_t num_rows = 0;  // rows of h: this rank's routed rows from every source
};

void check_group(int64_t tp, int64_t ep, int64_t tp_rank, int64_t ep_rank, int64_t hidden,
                 int64_t bm, int64_t bn) {
  if (tp < 1 || ep < 1 || tp_rank < 0 || tp_rank >= tp || ep_rank < 0 || ep_rank >= ep) {
    fail("tp_rank=" + std::to_string(tp_rank) + " of tp_size=" + std::to_string(tp) +
         ", ep_rank=" + std::to_string(ep_rank) + " of ep_size=" + std::to_string(ep) +
         ": expected sizes >= 1 and 0 <= rank < size");
  }
  if (hidden < 0 || bm < 1 || bn < 1) {
    fail("hidden=" + std::to_string(hidden) + ", bm=" + std::to_string(bm) + ", bn=" +
         std::to_string(bn) + ": expected hidden >= 0, bm >= 1, bn >= 1");
  }
  const int64_t count_end = int64_t(1) << 31;
  if (hidden >= count_end || bm >= count_end || bn >= count_end) {
    fail("hidden, bm and bn must be < 2^31");
  }
}

void check_routed_shape(const Counts& routed_arr, int64_t R, int64_t ep) {
  if (routed_arr.ndim() != 2 || routed_arr.shape(0) != R || routed_arr.shape(1) == 0 ||
      routed_arr.shape(1) % ep != 0) {
    fail("routed must be [R=" + std::to_string(R) + ", E], E a positive multiple of ep_size=" +
         std::to_string(ep) + ", got shape " + shape_of(routed_arr));
  }
}

// Every count in [0, 2^31): then no sum or product below can overflow int64.
void check_counts(const int64_t* a, int64_t n, const char* what) {
  const int64_t count_end = int64_t(1) << 31;
  for (int64_t i = 0; i < n; ++i) {
    if (a[i] < 0 || a[i] >= count_end) fail(std::string(what) + " must be in [0, 2^31)");
  }
}

// The layout of one call from the checked counts: routed [R, E] (group order) and counts
// [L, R] (chunk order). Writes segments [R * L, 6], arrivals [R], recv_rows [R] and
// finalize_base [tp, E] through the given pointers.
LayoutScalars layout_core(const int64_t* routed, const int64_t* counts, int64_t tp, int64_t ep,
                          int64_t tp_rank, int64_t ep_rank, int64_t E, int64_t hidden,
                          int64_t bm, int64_t bn, int32_t* seg, int64_t* arrivals,
                          int64_t* recv_rows, int32_t* base) {
  const int64_t R = tp * ep, L = E / ep;
  const int64_t me = ep_rank * tp + tp_rank;
  LayoutScalars out;
  const int64_t col_blocks = out.col_blocks = cdiv(hidden, bn);

  // pre[g * (ep + 1) + j]: rank g's routed pairs with an expert on EP ranks < j. Rank g's
  // rows are, per sender s in group order, a block of (g's pairs on ep(s)) rows; its own
  // block (s = g) stays out of its receive buffer (the call's local buffer holds it).
  std::vector<int64_t> pre(R * (ep + 1), 0);
  for (int64_t g = 0; g < R; ++g) {
    for (int64_t e = 0; e < E; ++e) pre[g * (ep + 1) + e / L + 1] += routed[g * E + e];
    for (int64_t j = 0; j < ep; ++j) pre[g * (ep + 1) + j + 1] += pre[g * (ep + 1) + j];
  }
  // block(g, s): rows sender s computes for g's tokens.
  auto block = [&](int64_t g, int64_t s) {
    const int64_t* p = &pre[g * (ep + 1) + s / tp];
    return p[1] - p[0];
  };
  // offset(g, s), s != g: first row of sender s's block in g's receive buffer (the blocks of
  // the senders < s other than g); 0 for s = g (the local buffer's first row).
  auto offset = [&](int64_t g, int64_t s) {
    if (s == g) return int64_t(0);
    const int64_t* p = &pre[g * (ep + 1) + s / tp];
    return tp * p[0] + (s % tp) * (p[1] - p[0]) - (g < s ? block(g, g) : 0);
  };
  // rows each rank receives from the others: TP x its pairs, less its own block
  for (int64_t g = 0; g < R; ++g) recv_rows[g] = tp * pre[g * (ep + 1) + ep] - block(g, g);

  // h holds the (local expert l, chunk c) runs in row-major [L, R] order; run_start[l * R + c]
  // is the first row of run (l, c).
  std::vector<int64_t> run_start(L * R + 1, 0);
  for (int64_t i = 0; i < L * R; ++i) run_start[i + 1] = run_start[i] + counts[i];
  out.num_rows = run_start[L * R];

  // Segments: destinations in `destination_order` (me + 1, ..., me - 1, then me), local
  // experts ascending. Destination d receives source chunk c = tp(d) * EP + ep(d); this rank's
  // rows of (l, c) go after its rows of experts < l in its block of d's buffer.
  const int64_t int32_end = int64_t(1) << 31;
  int64_t first_tile = 0;
  for (int64_t i = 0; i < R; ++i) {
    const int64_t d = (me + 1 + i) % R;
    const int64_t c = (d % tp) * ep + d / tp;
    int64_t dest_row = offset(d, me);
    for (int64_t l = 0; l < L; ++l) {
      const int64_t rows = counts[l * R + c], h_row = run_start[l * R + c];
      const int64_t tiles = cdiv(rows, bm) * col_blocks;
      if (h_row + rows >= int32_end || dest_row + rows >= int32_end ||
          first_tile + tiles >= int32_end) {
        fail("a row or tile coordinate does not fit in int32");
      }
      int32_t* row = seg + (i * L + l) * 6;
      row[0] = int32_t(l);
      row[1] = int32_t(h_row);
      row[2] = int32_t(rows);
      row[3] = int32_t(d);
      row[4] = int32_t(dest_row);
      row[5] = int32_t(first_tile);
      (d == me ? out.num_local : out.num_remote) += tiles;
      first_tile += tiles;
      dest_row += rows;
    }
  }

  // arrivals[s]: tiles sender s stores into my buffer (my pairs of s's experts, tiled).
  const int64_t* mine = routed + me * E;
  std::vector<int64_t> tiles_from_ep(ep, 0);
  for (int64_t e = 0; e < E; ++e) tiles_from_ep[e / L] += cdiv(mine[e], bm) * col_blocks;
  for (int64_t s = 0; s < R; ++s) arrivals[s] = s == me ? 0 : tiles_from_ep[s / tp];

  // finalize_base[t, e] = row(sender) - first pair of e's EP rank + first pair of e - 1,
  // sender = TP rank t of e's EP rank, row(sender) = offset(me, sender), or recv_rows(me) for
  // this rank itself (the finalize reads rows from recv_rows(me) on from the local buffer);
  // int32, wrapping like numpy's astype.
  int64_t first_pair = 0, first_pair_of_ep = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (e % L == 0) first_pair_of_ep = first_pair;
    for (int64_t t = 0; t < tp; ++t) {
      const int64_t sender = (e / L) * tp + t;
      const int64_t row = sender == me ? recv_rows[me] : offset(me, sender);
      base[t * E + e] = int32_t(row - first_pair_of_ep + first_pair - 1);
    }
    first_pair += mine[e];
  }
  out.local_rows = block(me, me);
  out.num_pairs = first_pair;
  return out;
}

py::tuple direct_layout(const py::array& routed_in, const py::array& counts_in, int64_t tp,
                        int64_t ep, int64_t tp_rank, int64_t ep_rank, int64_t hidden,
                        int64_t bm, int64_t bn) {
  const Counts routed_arr = integer_counts(routed_in, "routed");
  const Counts counts_arr = integer_counts(counts_in, "rows_per_expert_per_chunk");
  check_group(tp, ep, tp_rank, ep_rank, hidden, bm, bn);
  const int64_t R = tp * ep;
  check_routed_shape(routed_arr, R, ep);
  const int64_t E = routed_arr.shape(1), L = E / ep;
  if (counts_arr.ndim() != 2 || counts_arr.shape(0) != L || counts_arr.shape(1) != R) {
    fail("rows_per_expert_per_chunk must be [L=" + std::to_string(L) + ", R=" +
         std::to_string(R) + "], got shape " + shape_of(counts_arr));
  }
  check_counts(routed_arr.data(), R * E, "routed counts");
  check_counts(counts_arr.data(), L * R, "rows_per_expert_per_chunk");
  py::array_t<int32_t> segments_arr({R * L, int64_t(6)});
  py::array_t<int64_t> arrivals_arr(R), recv_rows_arr(R);
  py::array_t<int32_t> base_arr({tp, E});
  const LayoutScalars s = layout_core(
      routed_arr.data(), counts_arr.data(), tp, ep, tp_rank, ep_rank, E, hidden, bm, bn,
      segments_arr.mutable_data(), arrivals_arr.mutable_data(), recv_rows_arr.mutable_data(),
      base_arr.mutable_data());
  return py::make_tuple(segments_arr, s.num_remote, s.num_local, s.col_blocks, arrivals_arr,
                        recv_rows_arr, s.local_rows, base_arr, s.num_pairs);
}

// An int64, C-contiguous 1-D array of n elements, used as is (the caller's own array).
void check_int64_vector(const py::array& a, int64_t n, const char* name) {
  if (!a.dtype().is(py::dtype::of<int64_t>()) || a.ndim() != 1 || a.shape(0) != n ||
      !(a.flags() & py::array::c_style)) {
    fail(std::string(name) + " must be a C-contiguous int64 array of shape (" +
         std::to_string(n) + ",), got dtype " + std::string(py::str(a.dtype())) + " shape " +
         std::string(py::str(a.attr("shape"))));
  }
}

py::tuple direct_tables(const py::array& routed_in, int64_t tp, int64_t ep, int64_t tp_rank,
                        int64_t ep_rank, int64_t hidden, int64_t bm, int64_t bn,
                        const py::array& expected_in, const py::array& next_in,
                        const py::array& out_in) {
  const Counts routed_arr = integer_counts(routed_in, "routed");
  check_group(tp, ep, tp_rank, ep_rank, hidden, bm, bn);
  const int64_t R = tp * ep;
  check_routed_shape(routed_arr, R, ep);
  const int64_t E = routed_arr.shape(1), L = E / ep;
  const int64_t* routed = routed_arr.data();
  check_counts(routed, R * E, "routed counts");
  check_int64_vector(expected_in, R, "expected");
  check_int64_vector(next_in, R, "next_expected");
  if (!next_in.writeable()) fail("next_expected must be writeable");
  const int64_t need = 2 * R + tp * E + R * L * 6;
  if (!out_in.dtype().is(py::dtype::of<int32_t>()) || out_in.ndim() != 1 ||
      !(out_in.flags() & py::array::c_style) || !out_in.writeable() || out_in.shape(0) < need) {
    fail("out must be a writeable, C-contiguous int32 array of at least " +
         std::to_string(need) + " elements (2R + TP * E + R * L * 6), got dtype " +
         std::string(py::str(out_in.dtype())) + " with " + std::to_string(out_in.size()) +
         " elements");
  }
  int32_t* out = static_cast<int32_t*>(py::array(out_in).mutable_data());
  // counts [L, R] chunk order from routed: chunk c = tp_i * EP + ep_i is group rank
  // ep_i * TP + tp_i; its rows of local expert l are its tokens of expert ep_rank * L + l.
  std::vector<int64_t> counts(L * R);
  for (int64_t c = 0; c < R; ++c) {
    const int64_t g = (c % ep) * tp + c / ep;
    for (int64_t l = 0; l < L; ++l) counts[l * R + c] = routed[g * E + ep_rank * L + l];
  }
  std::vector<int64_t> arrivals(R), recv_rows(R);
  const LayoutScalars s = layout_core(routed, counts.data(), tp, ep, tp_rank, ep_rank, E, hidden,
                                      bm, bn, out + 2 * R + tp * E, arrivals.data(),
                                      recv_rows.data(), out + 2 * R);
  // targets: the running totals after this call, int64 in [0, 2R) as int32 pairs
  const int64_t* expected = static_cast<const int64_t*>(expected_in.data());
  int64_t* next = static_cast<int64_t*>(py::array(next_in).mutable_data());
  int64_t recv_max = 0;
  for (int64_t r = 0; r < R; ++r) {
    next[r] = expected[r] + arrivals[r];
    std::memcpy(out + 2 * r, &next[r], sizeof(int64_t));
    if (recv_rows[r] > recv_max) recv_max = recv_rows[r];
  }
  const int64_t me = ep_rank * tp + tp_rank;
  return py::make_tuple(s.num_remote, s.num_local, s.col_blocks, s.local_rows, recv_rows[me],
                        recv_max, s.num_rows, s.num_pairs);
}

// The gather index of Megatron's sort by local expert: rows arrive chunk-major (source
// chunk c, then local expert l) and leave expert-major (l, then c); out[d] = the arriving
// row that goes to position d. O(L x R + N).
void local_expert_sort_index(const py::array& rows_in, const py::array& out_in) {
  const Counts rows_arr = integer_counts(rows_in, "rows_per_expert_per_chunk");
  if (rows_arr.ndim() != 2) {
    fail("rows_per_expert_per_chunk must be [L, R], got shape " + shape_of(rows_arr));
  }
  const int64_t L = rows_arr.shape(0), R = rows_arr.shape(1);
  const int64_t* rows = rows_arr.data();
  check_counts(rows, L * R, "rows_per_expert_per_chunk");
  std::vector<int64_t> source_start(L * R);
  int64_t n = 0;  // < L * R * 2^31: no overflow
  for (int64_t c = 0; c < R; ++c) {
    for (int64_t l = 0; l < L; ++l) {
      source_start[l * R + c] = n;
      n += rows[l * R + c];
    }
  }
  if (n >= (int64_t(1) << 31)) fail("the rows' total must be < 2^31, got " + std::to_string(n));
  if (!out_in.dtype().is(py::dtype::of<int32_t>()) || out_in.ndim() != 1 ||
      !(out_in.flags() & py::array::c_style) || !out_in.writeable() || out_in.shape(0) != n) {
    fail("out must be a writeable, C-contiguous int32 array of " + std::to_string(n) +
         " elements (the rows' total), got dtype " + std::string(py::str(out_in.dtype())) +
         " with " + std::to_string(out_in.size()) + " elements");
  }
  int32_t* out = static_cast<int32_t*>(py::array(out_in).mutable_data());
  for (int64_t i = 0; i < L * R; ++i) {
    const int64_t start = source_start[i], count = rows[i];
    for (int64_t k = 0; k < count; ++k) *out++ = static_cast<int32_t>(start + k);
  }
}

}  // namespace

PYBIND11_MODULE(_layout, m) {
  m.doc() = "C++ twin of triton_gemm2_gatherrs.direct_layout_numpy (host tables of one call) "
            "and the sort-by-local-expert index of the flag-on dispatcher";
  m.def("direct_tables", &direct_tables, py::arg("routed"), py::arg("tp_size"),
        py::arg("ep_size"), py::arg("tp_rank"), py::arg("ep_rank"), py::arg("hidden"),
        py::arg("bm"), py::arg("bn"), py::arg("expected"), py::arg("next_expected"),
        py::arg("out"),
        R"doc(One direct call's host tables, written straight into its staging buffer.

The same values as direct_layout (rows_per_expert_per_chunk derived from routed, as
metadata.triton_metadata does), without a numpy array per table: out[0:2R] receives the
targets (expected + arrivals, int64 as int32 pairs), out[2R:2R + TP*E] the finalize bases
and out[2R + TP*E:][:R*L*6] the segments; next_expected[:] = expected + arrivals (the
workspace's running totals once the call is taken; expected is only read).

Args:
    routed: [R, E] integer array (values in [0, 2^31)), group order.
    tp_size, ep_size, tp_rank, ep_rank, hidden, bm, bn: as direct_layout.
    expected, next_expected: C-contiguous int64 arrays of shape (R,).
    out: writeable C-contiguous int32 array of at least 2R + TP*E + R*L*6 elements.

Returns:
    (num_remote, num_local, col_blocks, local_rows, recv_rows of this rank, the largest
    recv_rows of the group, rows of h, num_pairs).

Raises:
    ValueError: as direct_layout; expected / next_expected / out of the wrong dtype, shape or
        size, or not writeable.
)doc");
  m.def("local_expert_sort_index", &local_expert_sort_index,
        py::arg("rows_per_expert_per_chunk"), py::arg("out"),
        R"doc(The gather index of the sort by local expert (Megatron's unfused
sort_chunks_by_idxs in MoEAlltoAllTokenDispatcher.dispatch_postprocess), written into out.

Args:
    rows_per_expert_per_chunk: [L, R] integer array (values in [0, 2^31)), chunk order: rows
        of source chunk c for local expert l (GatherRSMetadata's field).
    out: writeable C-contiguous int32 array of N = the rows' total elements; out[d] is the
        arriving (chunk-major) row that goes to expert-major position d.

Raises:
    ValueError: a non-integer or non-2-D array, counts outside [0, 2^31), a total >= 2^31,
        or out of the wrong dtype, size or layout, or not writeable.
)doc");
  m.def("direct_layout", &direct_layout, py::arg("routed"), py::arg("rows_per_expert_per_chunk"),
        py::arg("tp_size"), py::arg("ep_size"), py::arg("tp_rank"), py::arg("ep_rank"),
        py::arg("hidden"), py::arg("bm"), py::arg("bn"),
        R"doc(Segments, arrival counts and finalize bases of one call (see DirectLayout).

Args:
    routed: [R, E] integer array (values in [0, 2^31)), group order: every rank's tokens per expert
        (meta.routed_counts); R = tp_size * ep_size, E a positive multiple of
        ep_size.
    rows_per_expert_per_chunk: [L, R] integer array, chunk order, L = E / ep_size.
    tp_size, ep_size, tp_rank, ep_rank: this rank's place in the tp_ep group.
    hidden, bm, bn: output columns and the BM x BN tile.

Returns:
    (segments int32 [R * L, 6], num_remote, num_local, col_blocks, arrivals int64 [R],
    recv_rows int64 [R] (rows from the other ranks), local_rows (this rank's own block),
    finalize_base int32 [tp_size, E], num_pairs).

Raises:
    ValueError: a non-integer array, bad shapes, sizes, ranks or tile shape, counts outside
        [0, 2^31), or a row or tile coordinate that does not fit in int32.
)doc");
}
