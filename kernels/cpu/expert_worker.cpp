// The CPU side of a decode graph's CPU branch: a thread that answers the device's jobs.
//
// Why a thread of its own (not the host stops of the segmented graphs): a whole-step decode
// graph cannot stop for the host, so a MoE layer whose misses are shared between the link and
// the CPU posts the CPU's share to a mailbox in pinned host memory and goes on copying the
// link's share; this thread sees the post, runs the SIMD expert kernel (ft_cpu_experts_on, the
// other file of this library, on the thread's own SpinTeam) from the pool and answers; the
// copy kernel spins on the answer before the layer's MoE kernels add it (kernels/cpu/worker.py
// has the layout, kernels/expert_fills.py the device side). No Python, no GIL and no CUDA
// runtime here: answering reads and writes host memory only, so it runs beside a graph replay;
// the copies behind (below) only queue driver-API copies on a side stream, after the answer.
//
// Protocol (ctrl is int64; the indexes are kernels/cpu/worker.py's):
//   device: writes tokens, rows, weights, hidden and the job's columns of I (COL_LO, COL_HI;
//           0, 0: whole experts); then POST = seq with a release store (sys)
//   worker: acquire-loads POST; when it differs from the last seq it answered, computes
//           out [T, H] fp32 from rows [T, K] (pool rows, -1 = not the CPU's) over those
//           columns, then counts the job, and release-stores ANSWER = seq
//   device: acquire-loads ANSWER until it equals seq, then reads out.
// One job is outstanding at a time: the device waits for each answer before its next post.
//
// Copies behind (the split expert; on while ft_worker_set_behind has slot banks): after ANSWER
// the worker copies columns [COL_LO, COL_HI) of pool row rows[p] into the cache slot
// fill_slots[p] (>= 0; each slot once per job), then marks landed[slot] = rows[p]: on CPU
// slots with memcpy and a release store, on CUDA slots with the copy engines on a side stream
// (driver API: the copies and the mark are queued, they land later). Then it release-stores
// BEHIND = seq (also for jobs without fills and failed jobs, which copy nothing, so a drain
// never hangs) and adds the slots queued to BEHIND_EXPERTS. ANSWER comes first: the device
// spins on it, and the copies are not part of the step.
//
// Idle: the thread spins (pause) for spin_ns after its last job (a decode step posts every few
// hundred microseconds), then sleeps on a condition variable in 1 ms slices until ft_worker_wake
// (called before each replay that may post) or the stop; a post seen on a slice's timeout is
// answered too, so a missed wake costs at most 1 ms, never a hang.

#include <immintrin.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

extern "C" {
int ft_cpu_experts(const void* hidden, const void* w13, const void* w2, int dtype,
                   const int64_t* rows, const float* topk_w, float* out, int64_t T, int64_t K,
                   int64_t n_rows, int64_t H, int64_t I, int64_t c0, int64_t c1, int threads);
void* ft_team_new(int threads, int64_t spin_ns);
void ft_team_free(void* team);
int ft_cpu_experts_on(void* team, const void* hidden, const void* w13, const void* w2, int dtype,
                      const int64_t* rows, const float* topk_w, float* out, int64_t T, int64_t K,
                      int64_t n_rows, int64_t H, int64_t I, int64_t c0, int64_t c1);
}

namespace {

// ctrl's entries (kernels/cpu/worker.py: POST, TOKENS, COL_LO, COL_HI, COLUMNS, BEHIND,
// BEHIND_EXPERTS, ANSWER, ERROR, JOBS, EXPERTS, BUSY_NS, MAX_JOB_NS)
constexpr int POST = 0, TOKENS = 1, COL_LO = 3, COL_HI = 4, COLUMNS = 5, BEHIND = 6,
              BEHIND_EXPERTS = 7, ANSWER = 8, ERROR = 9, JOBS = 11, EXPERTS = 12, BUSY_NS = 13,
              MAX_JOB_NS = 15;
// ERROR's codes of the copies behind (the kernel's are -1, -2, -4; a job too large -3): a fill
// slot outside the slot bank, one slot named for two pool rows in a job, and a CUDA driver
// call's nonzero CUresult r as CUDA_ERROR - r. The rest of the job's fills still go (CUDA: the
// job's copies stop at the failing call); BEHIND is stored either way.
constexpr int64_t BAD_SLOT = -5, SLOT_TWICE = -6, CUDA_ERROR = -100;

// cuda.h's CUDA_MEMCPY2D_v2 (the library neither includes nor links CUDA: it builds and loads
// where there is none; Python hands it libcuda's entry points).
struct CudaMemcpy2D {
  size_t srcXInBytes, srcY;
  int srcMemoryType;
  const void* srcHost;
  unsigned long long srcDevice;
  void* srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  int dstMemoryType;
  void* dstHost;
  unsigned long long dstDevice;
  void* dstArray;
  size_t dstPitch;
  size_t WidthInBytes, Height;
};
static_assert(sizeof(CudaMemcpy2D) == 128, "the layout of cuda.h's CUDA_MEMCPY2D_v2");
constexpr int CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2;
using CuCtxSetCurrent = int (*)(void* ctx);
using CuMemcpyHtoDAsync = int (*)(unsigned long long dst, const void* src, size_t bytes,
                                  void* stream);
using CuMemcpy2DAsync = int (*)(const CudaMemcpy2D* copy, void* stream);

// Where the copies behind go (ft_worker_set_behind): slot banks w13 [S, 2I, H], w2 [S, H, I]
// (each slot contiguous; the strides between slots in bytes) and landed [S], all on the
// device of the cache; ctx null: CPU slots.
struct Behind {
  char* w13;
  char* w2;
  int64_t slots, w13_stride, w2_stride;
  int64_t* landed;
  int64_t* landed_src;  // CUDA: pinned host staging of each slot's mark
  void* ctx;
  void* stream;
  CuCtxSetCurrent set_current;
  CuMemcpyHtoDAsync htod;
  CuMemcpy2DAsync copy2d;
  bool current = false;  // ctx made current on the worker thread (once per configuration)
};

struct Fill {
  int64_t lid, slot;
};

struct Args {
  int64_t* ctrl;
  const int64_t* rows;   // [T_max * K]
  const int64_t* fill_slots;  // [T_max * K] the slot each pair's columns go to behind, -1 none
  const float* weights;  // [T_max * K]
  const void* hidden;    // [T_max, H]
  float* out;            // [T_max, H]
  const void* w13;       // [N, 2I, H]
  const void* w2;        // [N, H, I]
  int dtype;
  int64_t n_rows, H, I, K, max_tokens;
  int64_t elem;  // bytes of a weight
  int threads;
  int64_t spin_ns;
  int spin_team;  // 1: the kernel on a SpinTeam of this thread's; 0: on its OpenMP team
};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::atomic<int64_t>& at(int64_t* ctrl, int64_t i) {
  // The entries are naturally aligned int64 in pinned memory; std::atomic_ref is C++20.
  return *reinterpret_cast<std::atomic<int64_t>*>(ctrl + i);
}

struct Worker {
  Args a;
  std::atomic<bool> stop{false};
  std::atomic<bool> woken{false};
  std::mutex mu;
  std::condition_variable cv;
  std::thread thread;
  void* team = nullptr;  // the kernel's threads (made by the thread itself, freed at its end)
  // The copies behind: held by the thread from a job's fills to its BEHIND and by
  // ft_worker_set_behind, so a configuration never changes under a job's copies.
  std::mutex behind_mu;
  std::unique_ptr<Behind> behind;
  std::vector<Fill> fills;  // the job's distinct (lid, slot), capacity T_max * K

  // The job's fills, read before its answer (after it the device may post the next job over
  // them): distinct slots, each checked against the slot bank. Returns 0 or an ERROR code.
  int64_t collect(int64_t pairs) {
    int64_t rc = 0;
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t lid = a.rows[p], slot = a.fill_slots[p];
      if (lid < 0 || slot < 0) continue;
      if (slot >= behind->slots) {
        rc = BAD_SLOT;
        continue;
      }
      bool seen = false;
      for (const Fill& f : fills) {
        if (f.slot != slot) continue;
        seen = true;
        if (f.lid != lid) rc = SLOT_TWICE;  // the first pair's row keeps the slot
        break;
      }
      if (!seen) fills.push_back({lid, slot});
    }
    return rc;
  }

  // Columns [c0, c1) of each fill's pool row into its slot, then the slot's mark. Returns the
  // slots done (CPU) or queued whole (CUDA); a failing driver call's code goes to ERROR.
  int64_t copy_behind(int64_t c0, int64_t c1) {
    Behind& b = *behind;
    const int64_t e = a.elem, H = a.H, I = a.I;
    const size_t half = size_t((c1 - c0) * H * e);  // gate rows [c0, c1), and up rows alike
    const size_t gate = size_t(c0 * H * e), up = size_t((I + c0) * H * e);
    if (!b.ctx) {
      for (const Fill& f : fills) {
        const char* s13 = static_cast<const char*>(a.w13) + f.lid * 2 * I * H * e;
        const char* s2 = static_cast<const char*>(a.w2) + f.lid * H * I * e;
        char* d13 = b.w13 + f.slot * b.w13_stride;
        char* d2 = b.w2 + f.slot * b.w2_stride;
        std::memcpy(d13 + gate, s13 + gate, half);
        std::memcpy(d13 + up, s13 + up, half);
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(d2 + (h * I + c0) * e, s2 + (h * I + c0) * e, size_t((c1 - c0) * e));
        at(b.landed, f.slot).store(f.lid, std::memory_order_release);
      }
      return int64_t(fills.size());
    }
    int r = 0;
    if (!b.current && (r = b.set_current(b.ctx)) == 0) b.current = true;
    int64_t queued = 0;
    for (const Fill& f : fills) {
      if (r != 0) break;
      const char* s13 = static_cast<const char*>(a.w13) + f.lid * 2 * I * H * e;
      const unsigned long long d13 =
          reinterpret_cast<uintptr_t>(b.w13) + uint64_t(f.slot * b.w13_stride);
      CudaMemcpy2D w2{};  // w2's columns [c0, c1): H rows of (c1 - c0) weights, pitch I
      w2.srcMemoryType = CU_MEMORYTYPE_HOST;
      w2.srcHost = static_cast<const char*>(a.w2) + (f.lid * H * I + c0) * e;
      w2.srcPitch = size_t(I * e);
      w2.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      w2.dstDevice = reinterpret_cast<uintptr_t>(b.w2) + uint64_t(f.slot * b.w2_stride + c0 * e);
      w2.dstPitch = size_t(I * e);
      w2.WidthInBytes = size_t((c1 - c0) * e);
      w2.Height = size_t(H);
      // The mark is staged in pinned memory (an async copy reads its source when it runs);
      // the engine refills a slot only after its copies behind have landed, so no later job
      // rewrites a staged mark still queued.
      b.landed_src[f.slot] = f.lid;
      r = b.htod(d13 + gate, s13 + gate, half, b.stream);
      if (r == 0) r = b.htod(d13 + up, s13 + up, half, b.stream);
      if (r == 0) r = b.copy2d(&w2, b.stream);
      const unsigned long long mark = reinterpret_cast<uintptr_t>(b.landed + f.slot);
      if (r == 0) r = b.htod(mark, b.landed_src + f.slot, sizeof(int64_t), b.stream);
      queued += r == 0;
    }
    if (r != 0) at(a.ctrl, ERROR).store(CUDA_ERROR - r, std::memory_order_relaxed);
    return queued;
  }

  void answer(int64_t seq) {
    const int64_t t0 = now_ns();
    int64_t T = at(a.ctrl, TOKENS).load(std::memory_order_relaxed);
    // The job's columns of I (the split expert's CPU half); COL_HI 0: the whole width.
    const int64_t c0 = at(a.ctrl, COL_LO).load(std::memory_order_relaxed);
    const int64_t c1_posted = at(a.ctrl, COL_HI).load(std::memory_order_relaxed);
    const int64_t c1 = c1_posted == 0 ? a.I : c1_posted;
    int rc = 0;
    if (T < 0 || T > a.max_tokens) {
      rc = -3;  // a job larger than the mailbox: answered with an error, nothing computed
    } else {
      rc = team ? ft_cpu_experts_on(team, a.hidden, a.w13, a.w2, a.dtype, a.rows, a.weights,
                                    a.out, T, a.K, a.n_rows, a.H, a.I, c0, c1)
                : ft_cpu_experts(a.hidden, a.w13, a.w2, a.dtype, a.rows, a.weights, a.out, T, a.K,
                                 a.n_rows, a.H, a.I, c0, c1, a.threads);
    }
    std::lock_guard<std::mutex> behind_lock(behind_mu);
    fills.clear();  // a failed job copies nothing: its rows and columns are not checked
    if (behind && rc == 0) {
      if (const int64_t bad = collect(T * a.K)) at(a.ctrl, ERROR).store(bad);
    }
    int64_t experts = 0;  // distinct rows computed (the pool bytes read)
    if (rc == 0) {
      for (int64_t p = 0; p < T * a.K; ++p) {
        if (a.rows[p] < 0) continue;
        bool seen = false;
        for (int64_t q = 0; q < p && !seen; ++q) seen = a.rows[q] == a.rows[p];
        experts += !seen;
      }
    } else {
      at(a.ctrl, ERROR).store(rc, std::memory_order_relaxed);
    }
    at(a.ctrl, EXPERTS).fetch_add(experts, std::memory_order_relaxed);
    // The pool bytes read are experts x columns / I of an expert's: a range reads its slice.
    at(a.ctrl, COLUMNS).fetch_add(experts * (c1 - c0), std::memory_order_relaxed);
    const int64_t took = now_ns() - t0;
    at(a.ctrl, BUSY_NS).fetch_add(took, std::memory_order_relaxed);
    if (took > at(a.ctrl, MAX_JOB_NS).load(std::memory_order_relaxed))
      at(a.ctrl, MAX_JOB_NS).store(took, std::memory_order_relaxed);
    at(a.ctrl, JOBS).fetch_add(1, std::memory_order_relaxed);
    at(a.ctrl, ANSWER).store(seq, std::memory_order_release);
    if (!behind) return;
    if (!fills.empty())
      at(a.ctrl, BEHIND_EXPERTS).fetch_add(copy_behind(c0, c1), std::memory_order_relaxed);
    at(a.ctrl, BEHIND).store(seq, std::memory_order_release);
  }

  void loop() {
    // The kernel's threads, made now (a job's deadline is the device's wait). A SpinTeam of
    // its own spins between jobs as this thread does (expert_kernel.cpp: OpenMP's idle threads
    // sleep almost at once when the process has more of them than cores, as it does beside
    // the caller's team); or this thread's OpenMP team, as measured on the H200 (nineteenth
    // session; the SpinTeam is not measured there yet).
    if (a.spin_team) {
      team = ft_team_new(a.threads, a.spin_ns);
    } else {
#pragma omp parallel num_threads(a.threads)
      { (void)0; }
    }
    int64_t last = at(a.ctrl, ANSWER).load(std::memory_order_relaxed);
    int64_t active = now_ns();
    while (!stop.load(std::memory_order_relaxed)) {
      const int64_t seq = at(a.ctrl, POST).load(std::memory_order_acquire);
      if (seq != last) {
        answer(seq);
        last = seq;
        active = now_ns();
        continue;
      }
      if (now_ns() - active < a.spin_ns) {
        _mm_pause();
        continue;
      }
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::milliseconds(1),
                  [&] { return woken.load() || stop.load(); });
      if (woken.exchange(false)) active = now_ns();
    }
    if (team) ft_team_free(team);
  }
};

}  // namespace

extern "C" {

// Starts the thread; returns its handle (nullptr when the arguments are invalid).
void* ft_worker_start(int64_t* ctrl, const int64_t* rows, const int64_t* fill_slots,
                      const float* weights, const void* hidden, float* out, const void* w13,
                      const void* w2, int dtype, int64_t n_rows, int64_t H, int64_t I, int64_t K,
                      int64_t max_tokens, int threads, int64_t spin_ns, int spin_team) {
  if (!ctrl || !rows || !fill_slots || !weights || !hidden || !out || !w13 || !w2 || K < 1 ||
      max_tokens < 1)
    return nullptr;
  auto* w = new Worker();
  const int64_t elem = dtype == 0 ? 4 : 2;  // fp32, else bf16 / fp16 (experts.py's DTYPE_ID)
  w->a = Args{ctrl, rows, fill_slots, weights, hidden,  out,     w13,      w2, dtype, n_rows,
              H,    I,    K,          max_tokens, elem, threads, spin_ns, spin_team};
  w->fills.reserve(size_t(max_tokens * K));  // no allocation between a post and its copies
  w->thread = std::thread([w] { w->loop(); });
  return w;
}

// The copies behind: slot banks w13 [S, 2I, H] and w2 [S, H, I] (each slot contiguous; the
// slot strides in weights), landed [S] int64 on their device; w13 null: off. CUDA slots:
// landed_src [S] pinned host, the context, the stream and libcuda's cuCtxSetCurrent,
// cuMemcpyHtoDAsync_v2 and cuMemcpy2DAsync_v2; ctx null: CPU slots (plain copies). Between
// jobs only (it waits for a job's copies to be queued). Returns 0, or -1 (and changes nothing)
// when the arguments are invalid.
int ft_worker_set_behind(void* handle, void* w13, void* w2, int64_t slots, int64_t w13_stride,
                         int64_t w2_stride, int64_t* landed, int64_t* landed_src, void* ctx,
                         void* stream, void* set_current, void* htod, void* copy2d) {
  auto* w = static_cast<Worker*>(handle);
  std::unique_ptr<Behind> b;
  if (w13) {
    if (!w2 || !landed || slots < 1 || w13_stride < 0 || w2_stride < 0) return -1;
    if (ctx && (!landed_src || !set_current || !htod || !copy2d)) return -1;
    const int64_t e = w->a.elem;
    b.reset(new Behind{static_cast<char*>(w13), static_cast<char*>(w2), slots, w13_stride * e,
                       w2_stride * e, landed, landed_src, ctx, stream,
                       reinterpret_cast<CuCtxSetCurrent>(set_current),
                       reinterpret_cast<CuMemcpyHtoDAsync>(htod),
                       reinterpret_cast<CuMemcpy2DAsync>(copy2d)});
  }
  std::lock_guard<std::mutex> lock(w->behind_mu);
  // The jobs answered before had no copies behind: a drain must not wait for theirs.
  if (b && !w->behind)
    at(w->a.ctrl, BEHIND).store(at(w->a.ctrl, ANSWER).load(std::memory_order_relaxed),
                                std::memory_order_release);
  w->behind = std::move(b);
  return 0;
}

// Before a replay that may post: the thread spins again from now (no-op while it spins).
void ft_worker_wake(void* handle) {
  auto* w = static_cast<Worker*>(handle);
  if (w->woken.exchange(true)) return;
  std::lock_guard<std::mutex> lock(w->mu);
  w->cv.notify_one();
}

// Stops and joins the thread (a job in progress finishes first), then frees it.
void ft_worker_stop(void* handle) {
  auto* w = static_cast<Worker*>(handle);
  {
    std::lock_guard<std::mutex> lock(w->mu);
    w->stop.store(true);
  }
  w->cv.notify_one();
  w->thread.join();
  delete w;
}

}  // extern "C"
