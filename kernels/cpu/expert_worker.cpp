// The CPU side of a decode graph's CPU branch: a thread that answers the device's jobs.
//
// Why a thread of its own (not the host stops of the segmented graphs): a whole-step decode
// graph cannot stop for the host, so a MoE layer whose misses are shared between the link and
// the CPU posts the CPU's share to a mailbox in pinned host memory and goes on copying the
// link's share; this thread sees the post, runs the SIMD expert kernel (ft_cpu_experts_on, the
// other file of this library, on the thread's own SpinTeam) from the pool and answers; the
// copy kernel spins on the answer before the layer's MoE kernels add it (kernels/cpu/worker.py
// has the layout, kernels/expert_fills.py the device side). No Python, no GIL and no CUDA call
// here: answering reads and writes host memory only, so it runs beside a graph replay, and no
// driver lock another thread holds can delay an answer the device spins on.
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
// Copies behind (the split expert; on while ft_worker_set_behind has slot banks): columns
// [COL_LO, COL_HI) of pool row rows[p] go into the cache slot fill_slots[p] (>= 0), then
// landed[slot] = rows[p], after the answer and off this thread. Before ANSWER the worker
// snapshots the job's (row, slot) pairs into the copier's ring (the device may post over the
// mailbox once answered); after ANSWER it pushes the job (every job while on: those without
// fills and failed ones too, so BEHIND advances in order) and wakes the copier, a second thread
// that makes the copies, CUDA ones through the driver, and stores BEHIND = seq
// (behind_copier.cpp). The worker never waits for it: on a full ring it drops the job's copies
// (BEHIND_ERROR -7) and goes on.
//
// Idle: the thread spins (pause) for spin_ns after its last job (a decode step posts every few
// hundred microseconds), then sleeps on a condition variable in 1 ms slices until ft_worker_wake
// (called before each replay that may post) or the stop; a post seen on a slice's timeout is
// answered too, so a missed wake costs at most 1 ms, never a hang.

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

extern "C" {
int ft_cpu_experts(const void* hidden, const void* w13, const void* w2, int dtype,
                   const int64_t* rows, const float* topk_w, float* out, int64_t T, int64_t K,
                   int64_t n_rows, int64_t H, int64_t I, int64_t c0, int64_t c1, int threads);
void* ft_team_new(int threads, int64_t spin_ns, const int* cpus, int n_cpus);
int ft_team_pinned(void* team);
int ft_pin_to(int cpu);
void ft_team_free(void* team);
int ft_cpu_experts_on(void* team, const void* hidden, const void* w13, const void* w2, int dtype,
                      const int64_t* rows, const float* topk_w, float* out, int64_t T, int64_t K,
                      int64_t n_rows, int64_t H, int64_t I, int64_t c0, int64_t c1);
// The copier of the copies behind (behind_copier.cpp).
void* ft_copier_new(int64_t* ctrl, const void* w13, const void* w2, int64_t elem, int64_t H,
                    int64_t I, int64_t max_pairs, int64_t ring);
int64_t* ft_copier_begin(void* copier);
void ft_copier_push(void* copier, int64_t seq, int64_t c0, int64_t c1, int64_t n);
void ft_copier_drop(void* copier, int64_t seq, int64_t n);
int ft_copier_configure(void* copier, void* w13, void* w2, int64_t slots, int64_t w13_stride,
                        int64_t w2_stride, int64_t* landed, int64_t* landed_src, void* ctx,
                        void* stream, void* set_current, void* htod, void* copy2d);
void ft_copier_stop(void* copier);
}

namespace {

// ctrl's entries (kernels/cpu/worker.py: POST, TOKENS, COL_LO, COL_HI, COLUMNS, ANSWER, ERROR,
// JOBS, EXPERTS, BUSY_NS, MAX_JOB_NS, SLOW_JOBS, STALLED_JOBS; BEHIND and BEHIND_EXPERTS are the
// copier's)
constexpr int POST = 0, TOKENS = 1, COL_LO = 3, COL_HI = 4, COLUMNS = 5, ANSWER = 8, ERROR = 9,
              JOBS = 11, EXPERTS = 12, BUSY_NS = 13, MAX_JOB_NS = 15, SLOW_JOBS = 17,
              STALLED_JOBS = 18, PINNED = 19, PINS_KNOWN = 20;
constexpr int64_t SLOW_JOB_NS = 1000000, STALL_NS = 4000000;  // worker.py's

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
  std::vector<int> cpus;  // the cores the thread and its SpinTeam are pinned to (empty: none)
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
  // The copies behind: the copier (made by the first configuration) and whether they are on
  // (set after the copier, so a worker that reads true finds it).
  void* copier = nullptr;
  std::atomic<bool> behind_on{false};

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
    // The copies behind's pairs, snapshotted before the answer (after it the device may post the
    // next job over them); a failed job copies nothing: its rows and columns are not checked.
    const bool behind = behind_on.load(std::memory_order_acquire);
    int64_t* pairs = behind ? ft_copier_begin(copier) : nullptr;  // null: the ring is full
    int64_t fills = 0;
    for (int64_t p = 0; behind && rc == 0 && p < T * a.K; ++p) {
      const int64_t lid = a.rows[p], slot = a.fill_slots[p];
      if (lid < 0 || slot < 0) continue;
      if (pairs) pairs[2 * fills] = lid, pairs[2 * fills + 1] = slot;
      ++fills;
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
    if (took > SLOW_JOB_NS) at(a.ctrl, SLOW_JOBS).fetch_add(1, std::memory_order_relaxed);
    if (took > STALL_NS) at(a.ctrl, STALLED_JOBS).fetch_add(1, std::memory_order_relaxed);
    at(a.ctrl, JOBS).fetch_add(1, std::memory_order_relaxed);
    at(a.ctrl, ANSWER).store(seq, std::memory_order_release);
    if (!behind) return;
    if (pairs)
      ft_copier_push(copier, seq, c0, c1, fills);
    else
      ft_copier_drop(copier, seq, fills);
  }

  void loop() {
    // The kernel's threads, made now (a job's deadline is the device's wait). A SpinTeam of
    // its own spins between jobs as this thread does (expert_kernel.cpp: OpenMP's idle threads
    // sleep almost at once when the process has more of them than cores, as it does beside
    // the caller's team); or this thread's OpenMP team, as measured on the H200 (nineteenth
    // session; the SpinTeam is not measured there yet).
    // Pinned (FREETOKEN_WORKER_CPUS): this thread to cpus[0], its team's thread t to
    // cpus[t % n]; ctrl[PINNED] counts the threads pinned, then PINS_KNOWN = 1.
    int pinned = !a.cpus.empty() && ft_pin_to(a.cpus[0]) == 0;
    if (a.spin_team) {
      team = ft_team_new(a.threads, a.spin_ns, a.cpus.data(), static_cast<int>(a.cpus.size()));
      pinned += ft_team_pinned(team);
    } else {
#pragma omp parallel num_threads(a.threads)
      { (void)0; }
    }
    at(a.ctrl, PINNED).store(pinned, std::memory_order_relaxed);
    at(a.ctrl, PINS_KNOWN).store(1, std::memory_order_release);
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
                      int64_t max_tokens, int threads, int64_t spin_ns, int spin_team,
                      const int* cpus, int n_cpus) {
  if (!ctrl || !rows || !fill_slots || !weights || !hidden || !out || !w13 || !w2 || K < 1 ||
      max_tokens < 1 || (n_cpus > 0 && !cpus))
    return nullptr;
  auto* w = new Worker();
  const int64_t elem = dtype == 0 ? 4 : 2;  // fp32, else bf16 / fp16 (experts.py's DTYPE_ID)
  w->a = Args{ctrl, rows, fill_slots, weights, hidden,  out,     w13,      w2, dtype, n_rows,
              H,    I,    K,          max_tokens, elem, threads, spin_ns, spin_team,
              std::vector<int>(cpus, cpus + std::max(0, n_cpus))};
  w->thread = std::thread([w] { w->loop(); });
  return w;
}

// The copies behind: slot banks w13 [S, 2I, H] and w2 [S, H, I] (each slot contiguous; the
// slot strides in weights), landed [S] int64 on their device; w13 null: off. CUDA slots:
// landed_src [S] pinned host, the context, the stream and libcuda's cuCtxSetCurrent,
// cuMemcpyHtoDAsync_v2 and cuMemcpy2DAsync_v2; ctx null: CPU slots (plain copies). `ring`: the
// copier's ring in jobs, fixed by the first accepted configuration (later ones' are ignored).
// Between jobs only; waits until the jobs queued before are copied. Returns 0, or -1 (and
// changes nothing) when the arguments are invalid.
int ft_worker_set_behind(void* handle, void* w13, void* w2, int64_t slots, int64_t w13_stride,
                         int64_t w2_stride, int64_t* landed, int64_t* landed_src, void* ctx,
                         void* stream, void* set_current, void* htod, void* copy2d,
                         int64_t ring) {
  auto* w = static_cast<Worker*>(handle);
  const bool first = !w->copier;
  if (first) {
    if (!w13) return 0;  // off, and never on
    const Args& a = w->a;
    w->copier = ft_copier_new(a.ctrl, a.w13, a.w2, a.elem, a.H, a.I, a.max_tokens * a.K, ring);
    if (!w->copier) return -1;
  }
  if (!w13) w->behind_on.store(false, std::memory_order_release);  // no job pushes from now
  const int rc = ft_copier_configure(w->copier, w13, w2, slots, w13_stride, w2_stride, landed,
                                     landed_src, ctx, stream, set_current, htod, copy2d);
  if (rc == 0 && w13) w->behind_on.store(true, std::memory_order_release);
  if (rc != 0 && first) {  // refused: no copier yet (its thread never started)
    ft_copier_stop(w->copier);
    w->copier = nullptr;
  }
  return rc;
}

// Before a replay that may post: the thread spins again from now (no-op while it spins).
void ft_worker_wake(void* handle) {
  auto* w = static_cast<Worker*>(handle);
  if (w->woken.exchange(true)) return;
  std::lock_guard<std::mutex> lock(w->mu);
  w->cv.notify_one();
}

// Stops and joins the thread (a job in progress finishes first), then the copier (after the
// copies queued), then frees them.
void ft_worker_stop(void* handle) {
  auto* w = static_cast<Worker*>(handle);
  {
    std::lock_guard<std::mutex> lock(w->mu);
    w->stop.store(true);
  }
  w->cv.notify_one();
  w->thread.join();
  if (w->copier) ft_copier_stop(w->copier);
  delete w;
}

}  // extern "C"
