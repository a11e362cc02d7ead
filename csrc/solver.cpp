// Wave-quantized resource model of the fused GEMM2 + GatherRS kernel: the C++ solver.
//
// Same functions, arguments and integer arithmetic as the Python twin
// (megatron_overlap/resource/model.py, which derives the model; docs/resource_model.md has
// the prose). The twin tries every k; `solve` here finds the same k (the smallest with the
// least predicted time E(k) = max(R(k), W(k))) in O(1) in the common case and O(log G)
// otherwise, using that R is non-increasing and W non-decreasing in k.
//
// Times are int64 picoseconds. Bad input throws std::invalid_argument (pybind11 turns it
// into ValueError). Built as megatron_overlap.resource._solver by setup.py.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int64_t kMaxTiles = int64_t(1) << 30;
constexpr int64_t kMaxTimePs = int64_t(1) << 32;
constexpr int64_t kMaxCtas = int64_t(1) << 16;
// idle_ppm, the cost of a part-filled last wave's idle part in millionths of a wave: this
// value is the whole-wave model (every wave costs tau), 0 a fluid one.
constexpr int64_t kIdleWhole = 1000000;
using u128 = unsigned __int128;

[[noreturn]] void fail(const std::string& msg) { throw std::invalid_argument(msg); }

int64_t check_range(const char* name, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo || v > hi) {
    fail(std::string(name) + "=" + std::to_string(v) + ": expected an integer in [" +
         std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }
  return v;
}

double check_float(const char* name, double v, double lo) {
  if (!(std::isfinite(v) && v >= lo)) {
    fail(std::string(name) + "=" + std::to_string(v) + ": expected a finite number >= " +
         std::to_string(lo));
  }
  return v;
}

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }  // a >= 0, b > 0

int64_t round_ps(const char* name, double x) {
  double r = std::floor(x + 0.5);
  if (r > double(kMaxTimePs)) {
    fail(std::string(name) + "=" + std::to_string(r) + ": expected at most " +
         std::to_string(kMaxTimePs) + " ps");
  }
  return int64_t(r);
}

struct Problem {
  int64_t g, tr, tl, tau, c_link, c_cta, idle;
};

Problem check_problem(int64_t g, int64_t tr, int64_t tl, int64_t tau, int64_t c_link,
                      int64_t c_cta, int64_t idle = kIdleWhole) {
  return {check_range("num_ctas", g, 1, kMaxCtas), check_range("remote_tiles", tr, 0, kMaxTiles),
          check_range("local_tiles", tl, 0, kMaxTiles), check_range("tau_ps", tau, 1, kMaxTimePs),
          check_range("c_link_ps", c_link, 0, kMaxTimePs),
          check_range("c_cta_ps", c_cta, 0, kMaxTimePs),
          check_range("idle_ppm", idle, 0, kIdleWhole)};
}

// ---- the model (see model.py for the definitions) ---------------------------------------

inline int64_t remote_tile(const Problem& p, int64_t k) {
  return std::max(std::max(p.tau, k * p.c_link), p.c_cta);
}

inline int64_t remote_bound(const Problem& p, int64_t k) {  // R(k), non-increasing
  return std::max(cdiv(p.tr, k) * std::max(p.tau, p.c_cta), p.tr * p.c_link);
}

// The time of `work` ps x CTAs on G CTAs in waves of tau: whole waves, and a part-filled
// last wave (its busy fraction phi = rem / (G tau)) at tau x (phi + idle x (1 - phi)),
// rounded up. Non-decreasing in work (the last wave's cost rises with rem and never passes
// tau); idle = kIdleWhole gives ceil(work / (G tau)) x tau, the whole-wave model.
inline int64_t waves_time(u128 work, const Problem& p) {
  const u128 gt = u128(p.g) * u128(p.tau);
  const u128 full = work / gt, rem = work - full * gt;
  const int64_t t = int64_t(full) * p.tau;
  if (rem == 0) return t;
  if (p.idle == kIdleWhole) return t + p.tau;
  const u128 num = rem * u128(kIdleWhole - p.idle) + u128(p.idle) * gt;
  const u128 den = u128(p.g) * u128(kIdleWhole);
  return t + int64_t((num + den - 1) / den);
}

inline int64_t wave_bound(const Problem& p, int64_t k) {  // W(k), non-decreasing
  const int64_t trk = remote_tile(p, k);
  const int64_t gt = p.g * p.tau;
  int64_t a, b, s;
  if (p.idle == kIdleWhole && !__builtin_mul_overflow(p.tl, p.tau, &a) &&
      !__builtin_mul_overflow(p.tr, trk, &b) && !__builtin_add_overflow(a, b, &s)) {
    return cdiv(s, gt) * p.tau;
  }
  // T_r * tau_r(k) can pass 2^63 when k * c_link is huge; the quotient still fits.
  return waves_time(u128(p.tl) * u128(p.tau) + u128(p.tr) * u128(trk), p);
}

inline int64_t local_end(const Problem& p) {  // E without remote tiles: T_l tiles in waves
  return p.idle == kIdleWhole ? cdiv(p.tl, p.g) * p.tau
                              : waves_time(u128(p.tl) * u128(p.tau), p);
}

inline int64_t gemm_end_unchecked(const Problem& p, int64_t k) {
  return std::max(remote_bound(p, k), wave_bound(p, k));
}

// Smallest k in [1, kmax] with R(k) <= x, or 0 if none: ceil(T_r / k) * m <= x  <=>
// ceil(T_r / k) <= q = floor(x / m)  <=>  T_r <= k * q  <=>  k >= ceil(T_r / q).
inline int64_t smallest_k_with_remote_at_most(const Problem& p, int64_t x, int64_t kmax) {
  if (p.tr * p.c_link > x) return 0;
  const int64_t q = x / std::max(p.tau, p.c_cta);
  if (q == 0) return 0;
  const int64_t k = std::max<int64_t>(1, cdiv(p.tr, q));
  return k <= kmax ? k : 0;
}

std::pair<int64_t, int64_t> solve_unchecked(const Problem& p) {
  if (p.tr == 0) return {0, local_end(p)};
  if (p.g < 2) {
    fail("num_ctas=" + std::to_string(p.g) + ": " + std::to_string(p.tr) +
         " remote tiles need a grid of at least 2 CTAs (k communication CTAs, "
         "1 <= k <= G - 1)");
  }
  const int64_t kmax = p.g - 1;
  const int64_t m = std::max(p.tau, p.c_cta);
  // W(k) is the constant W0 while k * c_link <= m, i.e. for k <= ks.
  const int64_t ks = p.c_link == 0 ? kmax : std::min(kmax, m / p.c_link);
  // kc: the smallest k with R(k) <= W(k) (a monotone predicate), 0 if none.
  int64_t kc = 0;
  if (ks >= 1) {
    const int64_t w0 = wave_bound(p, 1);
    const int64_t k0 = smallest_k_with_remote_at_most(p, w0, kmax);
    if (k0 != 0 && k0 <= ks) kc = k0;
  }
  if (kc == 0 && ks < kmax) {  // search in (ks, kmax]
    int64_t lo = std::max<int64_t>(ks, 0), hi = kmax;  // P(lo) false (or lo = 0), P(hi)?
    if (remote_bound(p, hi) <= wave_bound(p, hi)) {
      // Here k * c_link > m, so R ~ max(T_r * m / k, T_r * c_link) and W ~ (T_l * tau +
      // T_r * c_link * k) / G. W meets the first term at the root of T_r c_link k^2 +
      // T_l tau k - T_r m G = 0 and the second at (T_r c_link G - T_l tau) / (T_r c_link);
      // the crossing is near the larger. Probing it and its neighbour usually pins kc in
      // two evaluations (a plain binary search takes ~7, each with two 64-bit divisions);
      // the binary search below finishes the job whenever the guess is off, so the result
      // is exact either way.
      const double a = double(p.tr) * double(p.c_link), b = double(p.tl) * double(p.tau);
      const double c = double(p.tr) * double(m) * double(p.g);
      const double root = std::max((-b + std::sqrt(b * b + 4.0 * a * c)) / (2.0 * a),
                                   (a * double(p.g) - b) / a);
      const int64_t guess = root >= double(hi) ? hi
                            : std::min(hi, std::max(lo + 1, int64_t(root)));
      if (remote_bound(p, guess) <= wave_bound(p, guess)) {
        hi = guess;
        if (guess - 1 > lo && !(remote_bound(p, guess - 1) <= wave_bound(p, guess - 1)))
          lo = guess - 1;
      } else {
        lo = guess;
        if (guess + 1 < hi && remote_bound(p, guess + 1) <= wave_bound(p, guess + 1))
          hi = guess + 1;
      }
      while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (remote_bound(p, mid) <= wave_bound(p, mid)) hi = mid; else lo = mid;
      }
      kc = hi;
    }
  }
  if (kc == 0) {  // R > W everywhere: E = R, least at kmax, first reached at kl
    const int64_t v = remote_bound(p, kmax);
    return {smallest_k_with_remote_at_most(p, v, kmax), v};
  }
  const int64_t vw = wave_bound(p, kc);
  if (kc == 1) return {1, vw};
  const int64_t vr = remote_bound(p, kc - 1);
  if (vr <= vw) return {smallest_k_with_remote_at_most(p, vr, kmax), vr};
  return {kc, vw};
}

// ---- bound functions --------------------------------------------------------------------

int64_t ctas_per_sm(int64_t regs, int64_t shared, int64_t threads, int64_t registers_per_sm,
                    int64_t max_registers_per_thread, int64_t register_alloc_unit,
                    int64_t shared_bytes_per_sm, int64_t max_shared_bytes_per_cta,
                    int64_t shared_reserved_bytes_per_cta, int64_t max_threads_per_sm,
                    int64_t max_threads_per_cta, int64_t max_ctas_per_sm) {
  const int64_t big = int64_t(1) << 40;
  check_range("registers_per_sm", registers_per_sm, 1, big);
  check_range("max_registers_per_thread", max_registers_per_thread, 1, big);
  check_range("register_alloc_unit", register_alloc_unit, 1, big);
  check_range("shared_bytes_per_sm", shared_bytes_per_sm, 1, big);
  check_range("max_shared_bytes_per_cta", max_shared_bytes_per_cta, 1, big);
  check_range("max_threads_per_sm", max_threads_per_sm, 1, big);
  check_range("max_threads_per_cta", max_threads_per_cta, 1, big);
  check_range("max_ctas_per_sm", max_ctas_per_sm, 1, big);
  check_range("shared_reserved_bytes_per_cta", shared_reserved_bytes_per_cta, 0, big);
  check_range("registers_per_thread", regs, 1, max_registers_per_thread);
  check_range("shared_bytes", shared, 0, max_shared_bytes_per_cta);
  check_range("threads_per_cta", threads, 1, max_threads_per_cta);
  const int64_t warps = cdiv(threads, 32);
  const int64_t regs_per_warp = cdiv(regs * 32, register_alloc_unit) * register_alloc_unit;
  const int64_t by_regs = (registers_per_sm / regs_per_warp) / warps;
  const int64_t per_cta = shared + shared_reserved_bytes_per_cta;
  const int64_t by_shared = per_cta > 0 ? shared_bytes_per_sm / per_cta : max_ctas_per_sm;
  const int64_t by_threads = max_threads_per_sm / (warps * 32);
  const int64_t ctas = std::min(std::min(by_regs, by_shared), std::min(by_threads,
                                                                       max_ctas_per_sm));
  if (ctas < 1) {
    fail("a CTA of " + std::to_string(threads) + " threads x " + std::to_string(regs) +
         " registers with " + std::to_string(shared) +
         " bytes of shared memory cannot be resident on one SM: registers allow " +
         std::to_string(by_regs) + ", shared memory " + std::to_string(by_shared) +
         ", threads " + std::to_string(by_threads));
  }
  return ctas;
}

struct TileCounts {
  int64_t remote, local, remote_rows;
};

TileCounts count_tiles_impl(const py::array& counts_in, int64_t local_chunk, int64_t bm,
                            int64_t bn, int64_t hidden) {
  const char kind = counts_in.dtype().kind();
  if (counts_in.ndim() != 2 || counts_in.shape(1) < 1 || (kind != 'i' && kind != 'u')) {
    fail("rows_per_expert_per_chunk must be an integer [L, R] array with R >= 1");
  }
  auto counts = py::array_t<int64_t, py::array::c_style | py::array::forcecast>(counts_in);
  const int64_t num_l = counts.shape(0), num_r = counts.shape(1);
  check_range("local_chunk", local_chunk, 0, num_r - 1);
  check_range("bm", bm, 1, int64_t(1) << 20);
  check_range("bn", bn, 1, int64_t(1) << 20);
  check_range("hidden", hidden, 1, int64_t(1) << 30);
  auto c = counts.unchecked<2>();
  const int64_t col_blocks = cdiv(hidden, bn);
  int64_t remote = 0, local = 0, remote_rows = 0;
  for (int64_t l = 0; l < num_l; ++l) {
    for (int64_t r = 0; r < num_r; ++r) {
      const int64_t n = c(l, r);
      if (n < 0) fail("rows_per_expert_per_chunk has a negative count " + std::to_string(n));
      if (n > kMaxTiles * bm) fail("rows_per_expert_per_chunk: count too large");
      const int64_t blocks = cdiv(n, bm);
      if (r == local_chunk) {
        local += blocks;
      } else {
        remote += blocks;
        remote_rows += n;
      }
      if (local + remote > kMaxTiles) break;
    }
  }
  if (remote > kMaxTiles / col_blocks || local > kMaxTiles / col_blocks ||
      (remote + local) * col_blocks > kMaxTiles) {
    fail("more than " + std::to_string(kMaxTiles) + " tiles");
  }
  return {remote * col_blocks, local * col_blocks, remote_rows};
}

py::tuple count_tiles(py::array counts_in, int64_t local_chunk, int64_t bm, int64_t bn,
                      int64_t hidden) {
  const TileCounts t = count_tiles_impl(counts_in, local_chunk, bm, bn, hidden);
  return py::make_tuple(t.remote, t.local, t.remote_rows);
}

Problem make_problem_impl(int64_t g, int64_t tr, int64_t tl, int64_t rows, int64_t hidden,
                          int64_t elem, int64_t ffn, int64_t bk, double alpha, double beta,
                          int64_t o_p, int64_t o_ref, double b_link, double b_cta) {
  check_range("num_ctas", g, 1, kMaxCtas);
  check_range("remote_tiles", tr, 0, kMaxTiles);
  check_range("local_tiles", tl, 0, kMaxTiles);
  check_range("remote_rows", rows, 0, kMaxTiles);
  check_range("hidden", hidden, 1, int64_t(1) << 30);
  check_range("elem_bytes", elem, 1, 16);
  check_range("ffn", ffn, 1, int64_t(1) << 30);
  check_range("bk", bk, 1, int64_t(1) << 20);
  check_range("ctas_per_sm", o_p, 1, 1 << 10);
  check_range("calibrated_ctas_per_sm", o_ref, 1, 1 << 10);
  check_float("alpha_us", alpha, 0.0);
  check_float("beta_us", beta, 0.0);
  check_float("link_bandwidth_gbps", b_link, 1e-9);
  check_float("cta_bandwidth_gbps", b_cta, 1e-9);
  if ((tr == 0) != (rows == 0)) {
    fail("remote_tiles=" + std::to_string(tr) + " and remote_rows=" + std::to_string(rows) +
         ": both must be 0 or both > 0");
  }
  const int64_t ksteps = cdiv(ffn, bk);
  // Same operations in the same order as model.py (bit-identical doubles).
  int64_t tau = round_ps("tau_ps", (alpha + beta * double(ksteps)) * 1e6 * double(o_p) /
                                       double(o_ref));
  tau = std::max<int64_t>(1, tau);
  int64_t c_link = 0, c_cta = 0;
  if (tr) {
    const double bytes = double(rows) * double(hidden) * double(elem);
    c_link = round_ps("c_link_ps", bytes * 1000.0 / (double(tr) * b_link));
    c_cta = round_ps("c_cta_ps", bytes * 1000.0 / (double(tr) * b_cta));
  }
  return {g, tr, tl, tau, c_link, c_cta, kIdleWhole};
}

py::tuple make_problem(int64_t g, int64_t tr, int64_t tl, int64_t rows, int64_t hidden,
                       int64_t elem, int64_t ffn, int64_t bk, double alpha, double beta,
                       int64_t o_p, int64_t o_ref, double b_link, double b_cta) {
  const Problem p = make_problem_impl(g, tr, tl, rows, hidden, elem, ffn, bk, alpha, beta, o_p,
                                      o_ref, b_link, b_cta);
  return py::make_tuple(p.g, p.tr, p.tl, p.tau, p.c_link, p.c_cta);
}

int64_t gemm_end(int64_t k, int64_t g, int64_t tr, int64_t tl, int64_t tau, int64_t c_link,
                 int64_t c_cta, int64_t idle) {
  const Problem p = check_problem(g, tr, tl, tau, c_link, c_cta, idle);
  if (p.tr == 0) {
    check_range("k", k, 0, p.g);
    return local_end(p);
  }
  check_range("k", k, 1, p.g);
  return gemm_end_unchecked(p, k);
}

py::tuple solve(int64_t g, int64_t tr, int64_t tl, int64_t tau, int64_t c_link,
                int64_t c_cta, int64_t idle) {
  const auto r = solve_unchecked(check_problem(g, tr, tl, tau, c_link, c_cta, idle));
  return py::make_tuple(r.first, r.second);
}

py::array_t<int64_t> solve_batch(py::array_t<int64_t, py::array::c_style | py::array::forcecast>
                                     problems) {
  if (problems.ndim() != 2 || (problems.shape(1) != 6 && problems.shape(1) != 7)) {
    fail("problems must be [n, 6] (G, T_r, T_l, tau, c_link, c_cta) or [n, 7] (and "
         "idle_ppm)");
  }
  const int64_t n = problems.shape(0);
  const bool with_idle = problems.shape(1) == 7;
  py::array_t<int64_t> out({n, int64_t(2)});
  auto in = problems.unchecked<2>();
  auto o = out.mutable_unchecked<2>();
  for (int64_t i = 0; i < n; ++i) {
    const auto r = solve_unchecked(
        check_problem(in(i, 0), in(i, 1), in(i, 2), in(i, 3), in(i, 4), in(i, 5),
                      with_idle ? in(i, 6) : kIdleWhole));
    o(i, 0) = r.first;
    o(i, 1) = r.second;
  }
  return out;
}

// Nanoseconds per `solve` (input checks included) over `iters` calls in a C++ loop; the
// local tile count varies with the iteration so that no call can be hoisted.
double bench_solve(int64_t g, int64_t tr, int64_t tl, int64_t tau, int64_t c_link,
                   int64_t c_cta, int64_t iters) {
  check_range("iters", iters, 1, int64_t(1) << 40);
  check_problem(g, tr, tl + 7, tau, c_link, c_cta);
  volatile int64_t sink = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iters; ++i) {
    const auto r = solve_unchecked(check_problem(g, tr, tl + (i & 7), tau, c_link, c_cta));
    sink = sink + r.first;
  }
  const auto end = std::chrono::steady_clock::now();
  (void)sink;
  return std::chrono::duration<double, std::nano>(end - start).count() / double(iters);
}

}  // namespace

// The combine mode (resource/mode.py): predicted time of the slowest rank in the direct and
// the pre-reduced mode, and which rank that is. The same loops and double operations, in
// the same order, as model.mode_times (bit-identical results).
int64_t stream_tau(const py::array& counts_in, int64_t bm, int64_t bn, int64_t hidden,
                   int64_t ffn, int64_t elem, int64_t g, int64_t tau, py::object fill_obj,
                   int64_t stream_mbps, int64_t reread);

// With a fill table or a streaming bandwidth each EP slice's tiles cost its own mean tile
// time (stream_tau of the slice's [L, R] counts, from tau), as model.mode_times (v6.8).
py::tuple mode_times(py::array counts_in, int64_t tp, int64_t ep, int64_t topk, int64_t hidden,
                     int64_t elem, int64_t g, int64_t tau, int64_t bm, int64_t bn,
                     double b_link, double b_hbm, int64_t idle, int64_t ffn,
                     py::object fill, int64_t stream_mbps, int64_t reread) {
  check_range("tp_size", tp, 1, int64_t(1) << 16);
  check_range("ep_size", ep, 1, int64_t(1) << 16);
  const int64_t r = tp * ep;
  const char kind = counts_in.dtype().kind();
  if (counts_in.ndim() != 2 || counts_in.shape(0) != r || (kind != 'i' && kind != 'u') ||
      counts_in.shape(1) < ep || counts_in.shape(1) % ep != 0) {
    fail("routed_counts must be an integer [TP * EP = " + std::to_string(r) +
         ", E] array with E divisible by EP = " + std::to_string(ep));
  }
  check_range("topk", topk, 1, int64_t(1) << 20);
  check_range("hidden", hidden, 1, int64_t(1) << 30);
  check_range("elem_bytes", elem, 1, 16);
  check_range("num_ctas", g, 1, kMaxCtas);
  check_range("tile_ps", tau, 1, kMaxTimePs);
  check_range("bm", bm, 1, int64_t(1) << 20);
  check_range("bn", bn, 1, int64_t(1) << 20);
  check_float("link_bandwidth_gbps", b_link, 1e-9);
  check_float("hbm_bandwidth_gbps", b_hbm, 1e-9);
  check_range("idle_ppm", idle, 0, kIdleWhole);
  auto counts = py::array_t<int64_t, py::array::c_style | py::array::forcecast>(counts_in);
  auto c = counts.unchecked<2>();
  const int64_t num_experts = counts.shape(1), num_local = num_experts / ep;
  for (int64_t d = 0; d < r; ++d) {
    for (int64_t e = 0; e < num_experts; ++e) {
      if (c(d, e) < 0) fail("routed_counts has a negative count " + std::to_string(c(d, e)));
      if (c(d, e) > kMaxTiles * bm) fail("routed_counts: count too large");
    }
  }
  const int64_t col_blocks = cdiv(hidden, bn);
  const int64_t k = std::min(topk, num_experts);
  double p_none = 0.0;
  if (ep > 1 && num_experts - num_local >= k) {
    p_none = 1.0;
    for (int64_t i = 0; i < k; ++i) {
      p_none *= double(num_experts - num_local - i) / double(num_experts - i);
    }
  }
  const double p_any = 1.0 - p_none;
  const double row_link = double(hidden) * double(elem) / (b_link * 1e3);
  const double row_hbm = double(hidden) * double(elem) / (b_hbm * 1e3);
  const double idle_frac = double(idle) / double(kIdleWhole);
  std::vector<int64_t> tokens(r), pairs(r), rows_to(r * ep), tiles_to(r * ep);
  for (int64_t d = 0; d < r; ++d) {
    int64_t sum = 0;
    for (int64_t j = 0; j < ep; ++j) {
      int64_t rows = 0, blocks = 0;
      for (int64_t e = j * num_local; e < (j + 1) * num_local; ++e) {
        rows += c(d, e);
        blocks += cdiv(c(d, e), bm);
      }
      rows_to[d * ep + j] = rows;
      tiles_to[d * ep + j] = blocks * col_blocks;
      sum += rows;
    }
    pairs[d] = sum;
    tokens[d] = cdiv(sum, topk);
  }
  std::vector<int64_t> tau_of(ep, tau);
  if (!fill.is_none() || stream_mbps != 0) {
    for (int64_t j = 0; j < ep; ++j) {
      py::array_t<int64_t> slice({num_local, r});
      auto sl = slice.mutable_unchecked<2>();
      for (int64_t l = 0; l < num_local; ++l) {
        for (int64_t d = 0; d < r; ++d) sl(l, d) = c(d, j * num_local + l);
      }
      tau_of[j] = stream_tau(slice, bm, bn, hidden, ffn, elem, g, tau, fill, stream_mbps, reread);
    }
  }
  double best[2] = {-1.0, -1.0};
  int64_t slowest[2] = {0, 0};
  for (int64_t q = 0; q < r; ++q) {
    const int64_t j = q / tp;
    int64_t rows_q = 0, tiles_q = 0;
    for (int64_t d = 0; d < r; ++d) {
      rows_q += rows_to[d * ep + j];
      tiles_q += tiles_to[d * ep + j];
    }
    // whole waves and the last one's busy fraction + idle x its idle fraction (at idle 1:
    // exactly ceil(tiles_q / G), as before v6.3)
    const int64_t full = tiles_q / g, rem = tiles_q - full * g;
    double waves = double(full);
    if (rem) waves += (double(rem) + idle_frac * double(g - rem)) / double(g);
    const double waves_us = waves * (double(tau_of[j]) / double(1000000));
    const double direct = std::max(waves_us, double(rows_q - rows_to[q * ep + j]) * row_link) +
                          double(pairs[q] * tp + tokens[q]) * row_hbm;
    double pre_rows = 0.0;
    for (int64_t d = 0; d < r; ++d) {
      if (d != q) pre_rows += std::min(double(rows_to[d * ep + j]), double(tokens[d]) * p_any);
    }
    const double pre = waves_us + double(rows_q) * row_hbm + pre_rows * row_link +
                       double((r + 1) * tokens[q]) * row_hbm;
    const double t[2] = {direct, pre};
    for (int m = 0; m < 2; ++m) {
      if (t[m] > best[m]) {
        best[m] = t[m];
        slowest[m] = q;
      }
    }
  }
  return py::make_tuple(best[0], best[1], slowest[0], slowest[1]);
}

// Mean cost of the call's tiles relative to a full one, in millionths (model.fill_ppm_of_call):
// floor(n / bm) full tiles and, where n mod bm > 0, one at fill[n mod bm] per (expert, chunk)
// block; the mean over the blocks, rounded to nearest. fill: int64 [bm + 1].
int64_t fill_ppm_of_call(const py::array& counts_in, int64_t bm, const py::array& fill_in) {
  check_range("bm", bm, 1, int64_t(1) << 20);
  const char fk = fill_in.dtype().kind();
  if (fill_in.ndim() != 1 || fill_in.shape(0) != bm + 1 || (fk != 'i' && fk != 'u')) {
    fail("fill_ppm must be an integer [BM + 1] = [" + std::to_string(bm + 1) +
         "] array of millionths in [1, " + std::to_string(kIdleWhole) + "], got a " +
         std::to_string(fill_in.ndim()) + "-d array of " +
         std::to_string(fill_in.size()) + " values, dtype kind '" + std::string(1, fk) + "'");
  }
  auto fill = py::array_t<int64_t, py::array::c_style | py::array::forcecast>(fill_in);
  auto f = fill.unchecked<1>();
  for (int64_t r = 1; r <= bm; ++r) {
    if (f(r) < 1 || f(r) > kIdleWhole) {
      fail("fill_ppm[" + std::to_string(r) + "]=" + std::to_string(f(r)) +
           ": expected millionths in [1, " + std::to_string(kIdleWhole) + "]");
    }
  }
  const char kind = counts_in.dtype().kind();
  if (counts_in.ndim() != 2 || (kind != 'i' && kind != 'u')) {
    fail("rows_per_expert_per_chunk must be an integer [L, R] array");
  }
  auto counts = py::array_t<int64_t, py::array::c_style | py::array::forcecast>(counts_in);
  const int64_t* c = counts.data();
  int64_t full = 0, blocks = 0, part = 0;
  for (py::ssize_t i = 0; i < counts.size(); ++i) {
    const int64_t n = c[i];
    if (n < 0) fail("rows_per_expert_per_chunk has a negative count " + std::to_string(n));
    if (n / bm > kMaxTiles) fail("more than " + std::to_string(kMaxTiles) + " row blocks");
    const int64_t rem = n % bm;
    full += n / bm;
    if (rem > 0) {
      ++blocks;
      part += f(rem);
    }
    if (full + blocks > kMaxTiles) fail("more than " + std::to_string(kMaxTiles) + " row blocks");
  }
  blocks += full;
  if (blocks == 0) return kIdleWhole;
  const int64_t weighted = full * kIdleWhole + part;  // <= 2^30 x 10^6 < 2^50
  return (2 * weighted + blocks) / (2 * blocks);
}

int64_t scale_tau(int64_t tau, int64_t fill_ppm) {
  check_range("tau_ps", tau, 1, kMaxTimePs);
  check_range("fill_ppm", fill_ppm, 1, kIdleWhole);
  return std::max<int64_t>(1, (2 * tau * fill_ppm + kIdleWhole) / (2 * kIdleWhole));
}

constexpr int64_t kMaxStreamBytes = int64_t(1) << 40;

// The call's mean tile time with the streaming term (model.stream_tau_ps, the same integer
// arithmetic): per (expert, chunk) block, floor(n / bm) full tiles and one of r = n mod bm
// rows, each at max(tau x fill, G x u / B_s), u the tile's HBM bytes x 10^6 (the expert's
// weight slice once plus q for each of its other row blocks, shared by its N row blocks;
// the rows' activations shared by the column tiles; the outputs). fill may be None.
int64_t stream_tau(const py::array& counts_in, int64_t bm, int64_t bn, int64_t hidden,
                   int64_t ffn, int64_t elem, int64_t g, int64_t tau, py::object fill_obj,
                   int64_t stream_mbps, int64_t reread) {
  check_range("tau_ps", tau, 1, kMaxTimePs);
  check_range("stream_mbps", stream_mbps, 0, int64_t(1) << 40);
  check_range("reread_ppm", reread, 0, kIdleWhole);
  check_range("bm", bm, 1, int64_t(1) << 20);
  check_range("bn", bn, 1, int64_t(1) << 20);
  check_range("hidden", hidden, 1, int64_t(1) << 30);
  check_range("ffn", ffn, 1, int64_t(1) << 30);
  check_range("elem_bytes", elem, 1, 16);
  check_range("num_ctas", g, 1, kMaxCtas);
  const int64_t mean_fill =
      fill_obj.is_none() ? kIdleWhole : fill_ppm_of_call(counts_in, bm, py::array(fill_obj));
  if (stream_mbps == 0) return scale_tau(tau, mean_fill);
  const std::pair<const char*, int64_t> blocks_[3] = {
      {"BN x F x elem_bytes", bn * ffn * elem}, {"BM x F x elem_bytes", bm * ffn * elem},
      {"BM x BN x elem_bytes", bm * bn * elem}};
  for (const auto& b : blocks_) {
    if (b.second > kMaxStreamBytes) {
      fail(std::string(b.first) + "=" + std::to_string(b.second) + ": expected at most " +
           std::to_string(kMaxStreamBytes) + " bytes");
    }
  }
  const char kind = counts_in.dtype().kind();
  if (counts_in.ndim() != 2 || (kind != 'i' && kind != 'u')) {
    fail("rows_per_expert_per_chunk must be an integer [L, R] array");
  }
  auto counts = py::array_t<int64_t, py::array::c_style | py::array::forcecast>(counts_in);
  const int64_t rows_n = counts.shape(0), cols_n = counts.shape(1);
  const int64_t* c = counts.data();
  int64_t all_blocks = 0;
  for (int64_t i = 0; i < rows_n * cols_n; ++i) {
    if (c[i] < 0) fail("rows_per_expert_per_chunk has a negative count " + std::to_string(c[i]));
    if (c[i] / bm > kMaxTiles) fail("more than " + std::to_string(kMaxTiles) + " row blocks");
    all_blocks += cdiv(c[i], bm);
    if (all_blocks > kMaxTiles) fail("more than " + std::to_string(kMaxTiles) + " row blocks");
  }
  py::array_t<int64_t, py::array::c_style | py::array::forcecast> table;
  const int64_t* f = nullptr;
  if (!fill_obj.is_none()) {
    table = py::array_t<int64_t, py::array::c_style | py::array::forcecast>(fill_obj);
    f = table.data();
  }
  const int64_t col_tiles = cdiv(hidden, bn);
  const u128 weights = u128(bn * ffn * elem);
  const u128 whole = u128(kIdleWhole);
  auto tile_ps = [&](int64_t r, u128 u_b) -> u128 {
    const u128 t = (f == nullptr || r == bm)
                       ? u128(tau)
                       : std::max<u128>(1, (2 * u128(tau) * u128(f[r]) + whole) / (2 * whole));
    const u128 u = u_b + u128(r * ffn * elem) * whole / u128(col_tiles) +
                   u128(r * bn * elem) * whole;
    return std::max<u128>(t, u128(g) * u / u128(stream_mbps));
  };
  u128 total = 0;
  int64_t blocks = 0;
  for (int64_t l = 0; l < rows_n; ++l) {
    const int64_t* row = c + l * cols_n;
    int64_t n_blocks = 0;
    for (int64_t j = 0; j < cols_n; ++j) n_blocks += cdiv(row[j], bm);
    if (n_blocks == 0) continue;
    const u128 u_b = weights * (whole + u128(n_blocks - 1) * u128(reread)) / u128(n_blocks);
    const u128 full_ps = tile_ps(bm, u_b);
    for (int64_t j = 0; j < cols_n; ++j) {
      const int64_t full = row[j] / bm, rem = row[j] % bm;
      total += u128(full) * full_ps;
      blocks += full;
      if (rem) {
        total += tile_ps(rem, u_b);
        ++blocks;
      }
    }
  }
  if (blocks == 0) return tau;
  const u128 mean = (2 * total + u128(blocks)) / (2 * u128(blocks));
  if (mean > u128(kMaxTimePs)) {
    fail("the call's mean tile time " +
         std::to_string(static_cast<unsigned long long>(
             mean > u128(~0ULL) ? ~0ULL : static_cast<unsigned long long>(mean))) +
         " ps: expected at most " + std::to_string(kMaxTimePs) + " ps");
  }
  return int64_t(mean);
}

// One plan's model in one call: count_tiles, make_problem, solve (or gemm_end_ps for an
// override k), the breakdown's three terms at the chosen k and, with routed counts, the
// combine mode's times (model.plan_call is the Python twin, same results).
py::tuple plan_call(py::array counts_in, int64_t local_chunk, int64_t bm, int64_t bn,
                    int64_t bk, int64_t hidden, int64_t elem, int64_t ffn, int64_t g,
                    double alpha, double beta, int64_t o_p, int64_t o_ref, double b_link,
                    double b_cta, int64_t override_k, py::object routed, int64_t tp,
                    int64_t ep, int64_t topk, int64_t mode_g, int64_t mode_tau,
                    double b_hbm, int64_t idle, py::object fill, int64_t stream_mbps,
                    int64_t reread) {
  const TileCounts t = count_tiles_impl(counts_in, local_chunk, bm, bn, hidden);
  Problem p = make_problem_impl(g, t.remote, t.local, t.remote_rows, hidden, elem, ffn, bk,
                                alpha, beta, o_p, o_ref, b_link, b_cta);
  if (!fill.is_none() || stream_mbps != 0) {
    p.tau = stream_tau(counts_in, bm, bn, hidden, ffn, elem, g, p.tau, fill, stream_mbps, reread);
  }
  p.idle = check_range("idle_ppm", idle, 0, kIdleWhole);
  int64_t k, end;
  if (override_k != 0) {
    k = override_k;
    end = gemm_end(k, p.g, p.tr, p.tl, p.tau, p.c_link, p.c_cta, p.idle);
  } else {
    const auto r = solve_unchecked(p);
    k = r.first;
    end = r.second;
  }
  int64_t terms[3] = {0, 0, end};
  if (p.tr && k >= 1) {
    terms[0] = remote_tile(p, k);
    terms[1] = remote_bound(p, k);
    terms[2] = wave_bound(p, k);
  }
  py::object mode = py::none();
  if (!routed.is_none()) {
    mode = mode_times(py::array(routed), tp, ep, topk, hidden, elem, mode_g, mode_tau, bm, bn,
                      b_link, b_hbm, idle, ffn, fill, stream_mbps, reread);
  }
  return py::make_tuple(k, end, p.tr, p.tl, p.tau, terms[0], terms[1], terms[2], mode);
}

PYBIND11_MODULE(_solver, m) {
  m.doc() = "C++ solver of the wave-quantized resource model (see resource/model.py)";
  m.def("ctas_per_sm", &ctas_per_sm, py::arg("registers_per_thread"), py::arg("shared_bytes"),
        py::arg("threads_per_cta"), py::kw_only(), py::arg("registers_per_sm"),
        py::arg("max_registers_per_thread"), py::arg("register_alloc_unit"),
        py::arg("shared_bytes_per_sm"), py::arg("max_shared_bytes_per_cta"),
        py::arg("shared_reserved_bytes_per_cta"), py::arg("max_threads_per_sm"),
        py::arg("max_threads_per_cta"), py::arg("max_ctas_per_sm"));
  m.def("count_tiles", &count_tiles, py::arg("rows_per_expert_per_chunk"),
        py::arg("local_chunk"), py::arg("bm"), py::arg("bn"), py::arg("hidden"));
  m.def("make_problem", &make_problem, py::arg("num_ctas"), py::arg("remote_tiles"),
        py::arg("local_tiles"), py::arg("remote_rows"), py::arg("hidden"),
        py::arg("elem_bytes"), py::arg("ffn"), py::arg("bk"), py::arg("alpha_us"),
        py::arg("beta_us"), py::arg("ctas_per_sm"), py::arg("calibrated_ctas_per_sm"),
        py::arg("link_bandwidth_gbps"), py::arg("cta_bandwidth_gbps"));
  m.def("gemm_end_ps", &gemm_end, py::arg("k"), py::arg("g"), py::arg("tr"), py::arg("tl"),
        py::arg("tau"), py::arg("c_link"), py::arg("c_cta"), py::arg("idle_ppm") = kIdleWhole);
  m.def("solve", &solve, py::arg("g"), py::arg("tr"), py::arg("tl"), py::arg("tau"),
        py::arg("c_link"), py::arg("c_cta"), py::arg("idle_ppm") = kIdleWhole);
  m.def("solve_batch", &solve_batch, py::arg("problems"));
  m.def("mode_times", &mode_times, py::arg("routed_counts"), py::arg("tp_size"),
        py::arg("ep_size"), py::arg("topk"), py::arg("hidden"), py::arg("elem_bytes"),
        py::arg("num_ctas"), py::arg("tile_ps"), py::arg("bm"), py::arg("bn"),
        py::arg("link_bandwidth_gbps"), py::arg("hbm_bandwidth_gbps"),
        py::arg("idle_ppm") = kIdleWhole, py::arg("ffn") = 0, py::arg("fill_ppm") = py::none(),
        py::arg("stream_mbps") = 0, py::arg("reread_ppm") = 0);
  m.def("plan_call", &plan_call, py::arg("rows_per_expert_per_chunk"), py::arg("local_chunk"),
        py::arg("bm"), py::arg("bn"), py::arg("bk"), py::arg("hidden"), py::arg("elem_bytes"),
        py::arg("ffn"), py::arg("num_ctas"), py::arg("alpha_us"), py::arg("beta_us"),
        py::arg("ctas_per_sm"), py::arg("calibrated_ctas_per_sm"),
        py::arg("link_bandwidth_gbps"), py::arg("cta_bandwidth_gbps"), py::arg("override_k"),
        py::arg("routed_counts"), py::arg("tp_size"), py::arg("ep_size"), py::arg("topk"),
        py::arg("mode_num_ctas"), py::arg("mode_tile_ps"), py::arg("hbm_bandwidth_gbps"),
        py::arg("idle_ppm") = kIdleWhole, py::arg("fill_ppm") = py::none(),
        py::arg("stream_mbps") = 0, py::arg("reread_ppm") = 0);
  m.def("stream_tau_ps", &stream_tau, py::arg("rows_per_expert_per_chunk"), py::arg("bm"),
        py::arg("bn"), py::arg("hidden"), py::arg("ffn"), py::arg("elem_bytes"),
        py::arg("num_ctas"), py::arg("tau"), py::arg("fill_ppm"), py::arg("stream_mbps"),
        py::arg("reread_ppm"));
  m.def("fill_ppm_of_call", [](py::array counts, int64_t bm, py::object fill) -> int64_t {
    return fill.is_none() ? kIdleWhole : fill_ppm_of_call(counts, bm, py::array(fill));
  }, py::arg("rows_per_expert_per_chunk"), py::arg("bm"), py::arg("fill_ppm"));
  m.def("scale_tau_ps", &scale_tau, py::arg("tau"), py::arg("fill_ppm"));
  m.def("bench_solve", &bench_solve, py::arg("g"), py::arg("tr"), py::arg("tl"),
        py::arg("tau"), py::arg("c_link"), py::arg("c_cta"), py::arg("iters"));
}
