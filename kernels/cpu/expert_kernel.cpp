// CPU SwiGLU experts for a few tokens, read straight from the expert pool.
//
// A plain C ABI, loaded with ctypes by kernels/cpu/experts.py, which compiles this file once per
// ISA (-mavx512f -mavx512bw -mavx512vl, or -mavx2; both with -mfma -mf16c -fopenmp) and caches
// the library. The vector layer just below is the only ISA-specific code: the kernel is written
// once and the ISA is a build flag, so the two builds cannot drift apart.
//
// Shapes (legend of kernels/reference.py): T tokens, H hidden, I expert width, K top-k,
// N pool rows, P = T * K pairs (pair p = t * K + k), R distinct rows the pairs picked.
//   hidden [T, H], w13 [N, 2I, H], w2 [N, H, I]: one dtype (fp32 / bf16 / fp16), contiguous
//   rows [T, K] int64 (negative = skip the pair), topk_w [T, K] fp32, out [T, H] fp32
//
// Decode is weight-bandwidth bound (a few pairs, megabytes per expert), so every weight is read
// once per call, by one thread, for all pairs that picked its row, and converted to fp32 in
// registers (bf16: widen and shift up 16 bits; fp16: vcvtph2ps). Phases, barrier-separated:
//   1. gate/up: the R * 2I weight rows split evenly over the threads   -> gu [P, 2I] fp32
//   2. act = silu(gate) * up, in place into gu[:, :I]
//   3. down: the R * H weight rows split the same way                  -> y [P, H] fp32
//   4. out[t] = sum_k w[t, k] * y[t * K + k], in the fixed order k = 0..K-1
// Each output element of phases 1 and 3 is one dot product in one fixed order (lanes, then the
// lane sum), whoever computes it: results are bitwise the same for any thread count or batch.

#include <immintrin.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

enum DType { F32 = 0, BF16 = 1, F16 = 2 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__FMA__)
#define FT_ISA 512
constexpr int VW = 16;  // fp32 lanes
constexpr int MT = 4;   // tokens per tile: 4 rows x 4 tokens = 16 of the 32 zmm accumulators
using vf = __m512;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline vf widen_bf16(__m256i v) {  // bf16 is the top half of an fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
template <int DT>
static inline vf vload(const void* p) {
  if constexpr (DT == F32) return _mm512_loadu_ps(p);
  const __m256i v = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  if constexpr (DT == BF16) return widen_bf16(v);
  return _mm512_cvtph_ps(v);
}
// n < VW elements at p, the other lanes zero; masked loads never touch memory past the end.
template <int DT>
static inline vf vload_tail(const void* p, int n) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
  if constexpr (DT == F32) return _mm512_maskz_loadu_ps(m, p);
  const __m256i v = _mm256_maskz_loadu_epi16(m, p);
  if constexpr (DT == BF16) return widen_bf16(v);
  return _mm512_cvtph_ps(v);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FT_ISA 256
constexpr int VW = 8;  // fp32 lanes
constexpr int MT = 2;  // 4 rows x 2 tokens = 8 accumulators, + 4 weights + x in 16 ymm registers
using vf = __m256;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
template <int DT>
static inline vf vload(const void* p) {
  if constexpr (DT == F32) return _mm256_loadu_ps(static_cast<const float*>(p));
  const __m128i v = _mm_loadu_si128(static_cast<const __m128i*>(p));
  if constexpr (DT == BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
  return _mm256_cvtph_ps(v);
}
// AVX2 has no 16-bit masked load: the tail goes through a zero-padded copy.
template <int DT>
static inline vf vload_tail(const void* p, int n) {
  alignas(32) unsigned char buf[32] = {};
  std::memcpy(buf, p, static_cast<size_t>(n) * (DT == F32 ? 4 : 2));
  return vload<DT>(buf);
}
#else
#error "build with -mavx512f -mavx512bw -mavx512vl -mfma, or -mavx2 -mfma -mf16c"
#endif

template <int DT>
constexpr int64_t elem_bytes() { return DT == F32 ? 4 : 2; }

// ys[t][j + r] = dot(weight row r, xs[t]) over n elements, r < nr <= 4, t < M.
// Four rows at once give four independent FMA chains per token and one x load per four FMAs.
// `next` is the block this thread reads after this one, prefetched at the position being read
// here: its rows start new 4 KB pages the hardware prefetcher has not seen, and one block ahead
// hides their latency. Into L2 (T1): at one token on the 2-core Xeon dev VM (AMX, 480 MB L3),
// +20% over no prefetch and +5% over T0 (which competes with the demand loads for L1 fill
// buffers); NTA halved the rate. Worth re-measuring on a 16-core host.
template <int DT, int M>
static void dot_block(const char* w, int64_t ld, int nr, int64_t n, const float* const* xs,
                      float* const* ys, int64_t j, const char* next) {
  constexpr int64_t E = elem_bytes<DT>();
  const char* wr[4];
  const char* pr[4];
  for (int r = 0; r < 4; ++r) {
    const int64_t rr = r < nr ? r : nr - 1;  // a short block repeats its last row; dropped below
    wr[r] = w + rr * ld * E;
    pr[r] = next + rr * ld * E;
  }
  vf acc[4][M];
  for (int r = 0; r < 4; ++r)
    for (int t = 0; t < M; ++t) acc[r][t] = vzero();
  int64_t h = 0;
  for (; h + 2 * VW <= n; h += 2 * VW) {  // two vectors per row per step: 64 bytes of bf16
    for (int r = 0; r < 4; ++r)
      for (int64_t b = 0; b < 2 * VW * E; b += 64)
        _mm_prefetch(pr[r] + h * E + b, _MM_HINT_T1);
    for (int u = 0; u < 2; ++u) {
      const int64_t o = h + u * VW;
      vf wv[4];
      for (int r = 0; r < 4; ++r) wv[r] = vload<DT>(wr[r] + o * E);
      for (int t = 0; t < M; ++t) {
        const vf xv = vload<F32>(xs[t] + o);
        for (int r = 0; r < 4; ++r) acc[r][t] = vfma(wv[r], xv, acc[r][t]);
      }
    }
  }
  for (; h < n; h += VW) {  // at most one full vector, then a masked tail
    const int rem = n - h < VW ? static_cast<int>(n - h) : VW;
    vf wv[4];
    for (int r = 0; r < 4; ++r)
      wv[r] = rem == VW ? vload<DT>(wr[r] + h * E) : vload_tail<DT>(wr[r] + h * E, rem);
    for (int t = 0; t < M; ++t) {
      const vf xv = rem == VW ? vload<F32>(xs[t] + h) : vload_tail<F32>(xs[t] + h, rem);
      for (int r = 0; r < 4; ++r) acc[r][t] = vfma(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int t = 0; t < M; ++t) ys[t][j + r] = vsum(acc[r][t]);
}

// All m pairs of one row block, in tiles of MT tokens: the block's weights (16 KB of bf16 at
// H = 2048) are read from memory once and from L1/L2 for the further tiles.
template <int DT>
static void dot_rows(const char* w, int64_t ld, int nr, int64_t n, const float* const* xs,
                     float* const* ys, int m, int64_t j, const char* next) {
  int s = 0;
  for (; s + MT <= m; s += MT) dot_block<DT, MT>(w, ld, nr, n, xs + s, ys + s, j, next);
  const int rest = m - s;  // < MT
  if (rest == 3) dot_block<DT, 3>(w, ld, nr, n, xs + s, ys + s, j, next);
  if (rest == 2) dot_block<DT, 2>(w, ld, nr, n, xs + s, ys + s, j, next);
  if (rest == 1) dot_block<DT, 1>(w, ld, nr, n, xs + s, ys + s, j, next);
}

// One GEMV phase over the R picked pool rows: ys[i][out0 + j] = dot(weight row first + j of
// the pool row, xs[i] from column col0) for j < per and the pairs i of that pool row; n elements
// a dot, rows `ld` elements apart, `expert_rows` rows a pool row. Full width: w13's 2I rows of H
// (per = expert_rows = 2I, ld = n = H), w2's H rows of I. A column range [c0, c1) of I (the
// split expert's CPU half): gate rows [c0, c1) and up rows [I + c0, I + c1) of w13, and every w2
// row's columns [c0, c1) (n = c1 - c0, ld = I, col0 = c0). The per * R weight rows are split
// evenly over the threads: each streams the same number of bytes, contiguously within an expert.
struct Gemv {
  const char* bank;
  int64_t per, n;          // output rows a pool row; elements a dot
  int64_t expert_rows;     // weight rows from one pool row to the next
  int64_t first, ld, col0; // first weight row in the pool row; row stride; first column read
  int64_t out0;            // output index of row `first`
  const int64_t* row;      // [R] pool rows, ascending
  const int* start;        // [R + 1] pair ranges into xs / ys
  const float* const* xs;  // [P'] inputs of the grouped pairs (from their column col0)
  float* const* ys;        // [P'] outputs of the grouped pairs
};

template <int DT>
static void run_gemv(const Gemv& g, int64_t R, int tid, int nth) {
  constexpr int64_t E = elem_bytes<DT>();
  const int64_t total = R * g.per;
  const int64_t lo = total * tid / nth, hi = total * (tid + 1) / nth;
  auto addr = [&](int64_t f) {
    const int64_t w = g.row[f / g.per] * g.expert_rows + g.first + f % g.per;
    return g.bank + (w * g.ld + g.col0) * E;
  };
  for (int64_t f = lo; f < hi;) {
    const int64_t e = f / g.per, j = f % g.per;
    const int nr = static_cast<int>(std::min<int64_t>({4, g.per - j, hi - f}));
    const char* next = f + nr < hi ? addr(f + nr) : addr(f);
    const int a = g.start[e], m = g.start[e + 1] - a;
    dot_rows<DT>(addr(f), g.ld, nr, g.n, g.xs + a, g.ys + a, m, g.out0 + j, next);
    f += nr;
  }
}

static inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// Pins the calling thread to core `cpu` (the CPU worker's FREETOKEN_WORKER_CPUS,
// kernels/cpu/worker.py has the why): 0, else pthread_setaffinity_np's error.
extern "C" int ft_pin_to(int cpu) {
  if (cpu < 0 || cpu >= CPU_SETSIZE) return EINVAL;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpu, &set);
  return pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Who runs the phases. OmpTeam: an OpenMP team of the calling thread (calls from Python: the
// team torch's CPU ops share and keep warm). SpinTeam: threads of the decode graph's CPU worker
// (expert_worker.cpp), which spin between its jobs: with the caller's OpenMP team beside it,
// the process has more OpenMP threads than cores, and libgomp then lets idle threads sleep
// almost at once (its throttled spin count), so every job and each of its three barriers would
// wait on futex wake-ups (a sleeping team cost ~200 us a 1-expert call on the H200 host,
// fourteenth session). Both split the work by (tid, nth) alike: the same bits either way.
struct OmpTeam {
  int threads;
  template <class F>
  void parallel(F&& f) {
#pragma omp parallel num_threads(threads)
    f(omp_get_thread_num(), omp_get_num_threads());
  }
  void sync() {
#pragma omp barrier
  }
};

class SpinTeam {
 public:
  // cpus [n_cpus] (n_cpus 0: none): thread tid runs on core cpus[tid % n_cpus] only (the
  // caller, tid 0, pins itself).
  SpinTeam(int n, int64_t spin_ns, const int* cpus, int n_cpus)
      : n_(std::max(1, n)), spin_ns_(spin_ns), cpus_(cpus, cpus + std::max(0, n_cpus)) {
    for (int tid = 1; tid < n_; ++tid) threads_.emplace_back([this, tid] { loop(tid); });
  }
  // Threads of the team (the caller aside) started, and of those pinned (each pins itself
  // as it starts, before it counts as started).
  int started() const { return started_.load(std::memory_order_acquire); }
  int pinned() const { return pinned_.load(std::memory_order_acquire); }
  int size() const { return n_; }
  ~SpinTeam() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  // f(tid, nth) on every thread of the team, the caller as tid 0; returns when all are done.
  template <class F>
  void parallel(F&& f) {
    using Fn = std::remove_reference_t<F>;
    job_ = [](void* c, int tid, int nth) { (*static_cast<Fn*>(c))(tid, nth); };
    ctx_ = &f;
    done_.store(0, std::memory_order_relaxed);
    hot_until_.store(now_ns() + spin_ns_, std::memory_order_relaxed);
    gen_.fetch_add(1, std::memory_order_release);
    {
      std::lock_guard<std::mutex> lock(mu_);  // a thread between its check and its wait
      if (sleepers_ > 0) cv_.notify_all();
    }
    f(0, n_);
    while (done_.load(std::memory_order_acquire) != n_ - 1) _mm_pause();
  }
  // A sense-reversing barrier: the team spins through a job's phases.
  void sync() {
    const uint64_t g = bar_gen_.load(std::memory_order_acquire);
    if (bar_count_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      bar_count_.store(0, std::memory_order_relaxed);
      bar_gen_.fetch_add(1, std::memory_order_release);
    } else {
      while (bar_gen_.load(std::memory_order_acquire) == g) _mm_pause();
    }
  }

 private:
  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void loop(int tid) {
    if (!cpus_.empty() && ft_pin_to(cpus_[tid % cpus_.size()]) == 0)
      pinned_.fetch_add(1, std::memory_order_release);
    started_.fetch_add(1, std::memory_order_release);
    uint64_t seen = 0;
    for (;;) {
      while (gen_.load(std::memory_order_acquire) == seen && !stop_.load()) {
        if (now_ns() < hot_until_.load(std::memory_order_relaxed)) {
          _mm_pause();
          continue;
        }
        std::unique_lock<std::mutex> lock(mu_);
        ++sleepers_;
        cv_.wait_for(lock, std::chrono::milliseconds(1),
                     [&] { return gen_.load() != seen || stop_.load(); });
        --sleepers_;
      }
      if (stop_.load()) return;
      seen = gen_.load(std::memory_order_acquire);
      job_(ctx_, tid, n_);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  const int n_;
  const int64_t spin_ns_;
  std::vector<std::thread> threads_;
  void (*job_)(void*, int, int) = nullptr;
  void* ctx_ = nullptr;
  std::atomic<uint64_t> gen_{0}, bar_gen_{0};
  std::atomic<int> done_{0}, bar_count_{0};
  std::atomic<int64_t> hot_until_{0};
  const std::vector<int> cpus_;
  std::atomic<int> started_{0}, pinned_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  int sleepers_ = 0;  // under mu_
};

template <int DT, class Team>
static void run(Team& team, const Gemv* up, int n_up, const Gemv& down, int64_t R,
                const int* pair, int64_t npairs, float* gu, float* y, const int64_t* rows,
                const float* topk_w, float* out, int64_t T, int64_t K, int64_t H, int64_t I,
                int64_t c0, int64_t c1) {
  team.parallel([&](int tid, int nth) {
    for (int u = 0; u < n_up; ++u) run_gemv<DT>(up[u], R, tid, nth);
    team.sync();
    const int64_t w = c1 - c0, acts = npairs * w;  // phase 2: the pairs' activations in range
    for (int64_t f = acts * tid / nth; f < acts * (tid + 1) / nth; ++f) {
      float* g = gu + pair[f / w] * 2 * I;
      const int64_t c = c0 + f % w;
      g[c] = silu(g[c]) * g[I + c];
    }
    team.sync();
    run_gemv<DT>(down, R, tid, nth);
    team.sync();
    const int64_t h0 = H * tid / nth, h1 = H * (tid + 1) / nth;  // phase 4: split over H
    for (int64_t t = 0; t < T; ++t) {
      float* o = out + t * H;
      for (int64_t h = h0; h < h1; ++h) o[h] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t p = t * K + k;
        if (rows[p] < 0) continue;  // a skipped pair adds nothing
        const float wk = topk_w[p];
        const float* yp = y + p * H;
        for (int64_t h = h0; h < h1; ++h) o[h] += wk * yp[h];
      }
    }
  });
}

// Returns 0, or -1 when a row is >= n_rows (nothing written), -2 for an unknown dtype, -4 for
// a column range not inside [0, I). Columns [c0, c1) of I only: the experts' sum over that
// slice of their width (SwiGLU is elementwise over I, so two complementary ranges add up to the
// whole expert); [0, I) is the whole expert, computed as it always was.
template <class Team>
static int experts(Team& team, const void* hidden, const void* w13, const void* w2, int dtype,
                   const int64_t* rows, const float* topk_w, float* out, int64_t T, int64_t K,
                   int64_t n_rows, int64_t H, int64_t I, int64_t c0, int64_t c1) {
  if (dtype != F32 && dtype != BF16 && dtype != F16) return -2;
  if (c0 < 0 || c1 > I || c0 >= c1) return -4;
  const int64_t P = T * K;
  std::vector<std::pair<int64_t, int>> picked;  // (row, pair) of the pairs that run
  for (int64_t p = 0; p < P; ++p) {
    if (rows[p] >= n_rows) return -1;
    if (rows[p] >= 0) picked.emplace_back(rows[p], static_cast<int>(p));
  }
  std::sort(picked.begin(), picked.end());  // ascending rows: the pool is read in address order
  std::vector<int64_t> row;                 // [R]
  std::vector<int> start, pair;             // [R + 1], [P']
  for (size_t i = 0; i < picked.size(); ++i) {
    if (i == 0 || picked[i].first != picked[i - 1].first) {
      row.push_back(picked[i].first);
      start.push_back(static_cast<int>(i));
    }
    pair.push_back(picked[i].second);
  }
  start.push_back(static_cast<int>(pair.size()));
  const int64_t R = static_cast<int64_t>(row.size()), np = static_cast<int64_t>(pair.size());

  // Scratch (fp32): upcast hidden [T, H], gate/up then act [P, 2I], per-pair down outputs [P, H].
  std::unique_ptr<float[]> xf(new float[dtype == F32 ? 1 : T * H]);
  std::unique_ptr<float[]> gu(new float[P * 2 * I + 1]), y(new float[P * H + 1]);
  const float* x = static_cast<const float*>(hidden);
  if (dtype != F32) {
    const uint16_t* src = static_cast<const uint16_t*>(hidden);
    for (int64_t e = 0; e < T * H; ++e) {
      if (dtype == F16) {
        xf[e] = _cvtsh_ss(src[e]);
      } else {
        const uint32_t u = static_cast<uint32_t>(src[e]) << 16;
        std::memcpy(&xf[e], &u, 4);
      }
    }
    x = xf.get();
  }
  std::vector<const float*> xs_up(np), xs_down(np);
  std::vector<float*> ys_up(np), ys_down(np);
  for (int64_t i = 0; i < np; ++i) {
    const int64_t p = pair[i];
    xs_up[i] = x + (p / K) * H;
    ys_up[i] = gu.get() + p * 2 * I;
    xs_down[i] = gu.get() + p * 2 * I + c0;  // the activation, written over the gate half
    ys_down[i] = y.get() + p * H;
  }
  const char* b13 = static_cast<const char*>(w13);
  const int* st = start.data();
  // Full width: w13's 2I rows in one pass (gate and up contiguous); a range: its gate rows
  // and its up rows, each contiguous.
  const bool whole = c0 == 0 && c1 == I;
  const Gemv up[2] = {
      {b13, whole ? 2 * I : c1 - c0, H, 2 * I, c0, H, 0, c0, row.data(), st, xs_up.data(),
       ys_up.data()},
      {b13, c1 - c0, H, 2 * I, I + c0, H, 0, I + c0, row.data(), st, xs_up.data(),
       ys_up.data()},
  };
  const int n_up = whole ? 1 : 2;
  const Gemv down{static_cast<const char*>(w2), H, c1 - c0, H, 0, I, c0, 0, row.data(), st,
                  xs_down.data(), ys_down.data()};
  if (dtype == F32)
    run<F32>(team, up, n_up, down, R, pair.data(), np, gu.get(), y.get(), rows, topk_w, out, T,
             K, H, I, c0, c1);
  else if (dtype == BF16)
    run<BF16>(team, up, n_up, down, R, pair.data(), np, gu.get(), y.get(), rows, topk_w, out, T,
              K, H, I, c0, c1);
  else
    run<F16>(team, up, n_up, down, R, pair.data(), np, gu.get(), y.get(), rows, topk_w, out, T,
             K, H, I, c0, c1);
  return 0;
}

extern "C" {

int ft_isa() { return FT_ISA; }

int ft_cpu_experts(const void* hidden, const void* w13, const void* w2, int dtype,
                   const int64_t* rows, const float* topk_w, float* out, int64_t T, int64_t K,
                   int64_t n_rows, int64_t H, int64_t I, int64_t c0, int64_t c1, int threads) {
  OmpTeam team{std::max(1, threads)};
  return experts(team, hidden, w13, w2, dtype, rows, topk_w, out, T, K, n_rows, H, I, c0, c1);
}

// The CPU worker's team (expert_worker.cpp): `threads` threads counting the caller, spinning
// for spin_ns after each job's start, then sleeping in 1 ms slices; thread tid pinned to
// cpus[tid % n_cpus] (n_cpus 0: none; tid 0, the caller, pins itself).
void* ft_team_new(int threads, int64_t spin_ns, const int* cpus, int n_cpus) {
  return new SpinTeam(threads, spin_ns, cpus, n_cpus);
}
// The team's threads pinned (0 without cpus), once every one has started (it waits for them).
int ft_team_pinned(void* team) {
  auto* t = static_cast<SpinTeam*>(team);
  while (t->started() < t->size() - 1) std::this_thread::yield();
  return t->pinned();
}
void ft_team_free(void* team) { delete static_cast<SpinTeam*>(team); }

int ft_cpu_experts_on(void* team, const void* hidden, const void* w13, const void* w2, int dtype,
                      const int64_t* rows, const float* topk_w, float* out, int64_t T, int64_t K,
                      int64_t n_rows, int64_t H, int64_t I, int64_t c0, int64_t c1) {
  return experts(*static_cast<SpinTeam*>(team), hidden, w13, w2, dtype, rows, topk_w, out, T, K,
                 n_rows, H, I, c0, c1);
}

}  // extern "C"
