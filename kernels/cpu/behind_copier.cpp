// The CPU worker's copies behind (the split expert; kernels/cpu/behind_copies.py): a second
// thread of the worker (expert_worker.cpp), the copier, copies each answered job's columns
// [COL_LO, COL_HI) of the pool rows its pairs name into their cache slots.
//
// Why a thread of its own: a CUDA driver call may block for long. Another thread (the engine's)
// can sit in a driver call that holds a driver lock (a graph launch on a full queue, a
// synchronize) while the device spins on the worker's next answer; a worker making these copies
// itself then answers late or never (measured on the H200, s28-split: a job unanswered for 2 s,
// jobs of up to 20 ms against 0.1). The worker calls no CUDA: it hands each answered job here
// through a ring and goes back to its mailbox; only this thread waits on the driver.
//
// The ring (one producer, the worker; one consumer, the copier; no lock): `cap` entries (seq,
// c0, c1, n), each with storage for max_pairs (pool row, slot) pairs, made once. Before ANSWER
// the worker takes entry head % cap's storage (ft_copier_begin; null: the ring is full) and
// writes the job's pairs with a row and a fill slot there (after ANSWER the device may post the
// next job over the mailbox); after ANSWER it publishes the entry (ft_copier_push: head + 1,
// release) and notifies the copier. The copier reads entry tail % cap in place, makes its
// copies, stores BEHIND = seq and only then advances tail (release): the storage is free again.
//
// BEHIND in order: while copies behind are on, the worker pushes every answered job, those
// without fills and failed ones too (n = 0), so BEHIND goes through every seq. Ring full (the
// copier far behind, e.g. stuck in the driver): the worker does not wait. ft_copier_drop stores
// BEHIND_ERROR = DROPPED when the job had fills (its copies are lost; the engine turns the
// split path off and evicts its slots in flight) and `dropped` = seq (release). The copier, finding the
// ring empty after an acquire load of `dropped`, stores BEHIND = dropped when larger: the jobs
// pushed before the drop are done then, and every job pushed after it has a larger seq, so
// BEHIND only grows and a drain (waiting for the last POST) ends.
//
// The copies: columns [c0, c1) of pool row lid into its slot, then landed[slot] = lid; on CPU
// slots with memcpy and a release store, on CUDA slots with the copy engines on a side stream
// through libcuda's driver API (queued: they land later; the context made current on this
// thread once per configuration). A job's fills are checked against the configuration they are
// copied under (the configuration mutex is held for the job's copies; the worker never takes it).
//
// Idle: the copier sleeps on a condition variable in 1 ms slices (the kernel's SpinTeam needs
// the cores); the worker notifies it after each push, so a missed notify costs at most 1 ms.

#include <pthread.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace {

// ctrl's entries (kernels/cpu/worker.py's indexes).
constexpr int BEHIND = 6, BEHIND_EXPERTS = 7, ANSWER = 8, BEHIND_ERROR = 16;
// BEHIND_ERROR's codes (apart from ERROR, the answers': a copy behind failing leaves every
// answer right, only the cache's slot unfinished, so the CPU share goes on): a fill
// slot outside the slot bank, one slot named for two pool rows in a job, a job's copies dropped
// (the ring full), and a CUDA driver call's nonzero CUresult r as CUDA_ERROR - r. The rest of
// the job's fills still go (CUDA: the job's copies stop at the failing call); BEHIND is stored
// either way.
constexpr int64_t BAD_SLOT = -5, SLOT_TWICE = -6, DROPPED = -7, CUDA_ERROR = -100;

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

// Where the copies go (ft_copier_configure): slot banks w13 [S, 2I, H], w2 [S, H, I] (each slot
// contiguous; the strides between slots in bytes) and landed [S], all on the device of the
// cache; ctx null: CPU slots.
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
  bool current = false;  // ctx made current on the copier's thread (once per configuration)
};

struct Fill {
  int64_t lid, slot;
};

struct Entry {
  int64_t seq, c0, c1, n;  // n pairs (lid, slot) in the entry's storage
};

std::atomic<int64_t>& at(int64_t* ctrl, int64_t i) {
  // The entries are naturally aligned int64 in pinned memory; std::atomic_ref is C++20.
  return *reinterpret_cast<std::atomic<int64_t>*>(ctrl + i);
}

struct Copier {
  int64_t* ctrl;
  const char* w13;  // the pool [N, 2I, H]
  const char* w2;   // [N, H, I]
  int64_t elem, H, I, max_pairs, cap;
  std::vector<Entry> entries;  // [cap]
  std::vector<int64_t> pairs;  // [cap, max_pairs, 2] (lid, slot)
  alignas(64) std::atomic<uint64_t> head{0};  // entries pushed (the worker's)
  alignas(64) std::atomic<uint64_t> tail{0};  // entries copied (the copier's)
  alignas(64) std::atomic<int64_t> dropped{0};  // the last seq dropped on a full ring
  std::atomic<bool> stop{false};
  std::mutex mu;  // the copier's sleep
  std::condition_variable cv;
  std::mutex config_mu;  // held by the copier over a job's copies and by a configuration
  std::unique_ptr<Behind> behind;
  std::vector<Fill> fills;  // a job's distinct (lid, slot), capacity max_pairs
  std::thread thread;

  // The job's distinct fills, each slot checked against the slot bank. Returns 0 or a
  // BEHIND_ERROR code.
  int64_t collect(const int64_t* p, int64_t n) {
    int64_t rc = 0;
    fills.clear();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t lid = p[2 * i], slot = p[2 * i + 1];
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
  // slots done (CPU) or queued whole (CUDA); a failing driver call's code goes to BEHIND_ERROR.
  int64_t copy_behind(int64_t c0, int64_t c1) {
    Behind& b = *behind;
    const int64_t e = elem;
    const size_t half = size_t((c1 - c0) * H * e);  // gate rows [c0, c1), and up rows alike
    const size_t gate = size_t(c0 * H * e), up = size_t((I + c0) * H * e);
    if (!b.ctx) {
      for (const Fill& f : fills) {
        const char* s13 = w13 + f.lid * 2 * I * H * e;
        const char* s2 = w2 + f.lid * H * I * e;
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
      const char* s13 = w13 + f.lid * 2 * I * H * e;
      const unsigned long long d13 =
          reinterpret_cast<uintptr_t>(b.w13) + uint64_t(f.slot * b.w13_stride);
      CudaMemcpy2D m{};  // w2's columns [c0, c1): H rows of (c1 - c0) weights, pitch I
      m.srcMemoryType = CU_MEMORYTYPE_HOST;
      m.srcHost = w2 + (f.lid * H * I + c0) * e;
      m.srcPitch = size_t(I * e);
      m.dstMemoryType = CU_MEMORYTYPE_DEVICE;
      m.dstDevice = reinterpret_cast<uintptr_t>(b.w2) + uint64_t(f.slot * b.w2_stride + c0 * e);
      m.dstPitch = size_t(I * e);
      m.WidthInBytes = size_t((c1 - c0) * e);
      m.Height = size_t(H);
      // The mark is staged in pinned memory (an async copy reads its source when it runs);
      // the engine refills a slot only after its copies behind have landed, so no later job
      // rewrites a staged mark still queued.
      b.landed_src[f.slot] = f.lid;
      r = b.htod(d13 + gate, s13 + gate, half, b.stream);
      if (r == 0) r = b.htod(d13 + up, s13 + up, half, b.stream);
      if (r == 0) r = b.copy2d(&m, b.stream);
      const unsigned long long mark = reinterpret_cast<uintptr_t>(b.landed + f.slot);
      if (r == 0) r = b.htod(mark, b.landed_src + f.slot, sizeof(int64_t), b.stream);
      queued += r == 0;
    }
    if (r != 0) at(ctrl, BEHIND_ERROR).store(CUDA_ERROR - r, std::memory_order_relaxed);
    return queued;
  }

  void copy_job(const Entry& job, const int64_t* p) {
    int64_t queued = 0;
    {
      std::lock_guard<std::mutex> lock(config_mu);
      if (behind && job.n > 0) {
        if (const int64_t bad = collect(p, job.n)) at(ctrl, BEHIND_ERROR).store(bad);
        if (!fills.empty()) queued = copy_behind(job.c0, job.c1);
      }
    }
    at(ctrl, BEHIND_EXPERTS).fetch_add(queued, std::memory_order_relaxed);
    at(ctrl, BEHIND).store(job.seq, std::memory_order_release);
  }

  // Nothing queued and every drop's seq stored in BEHIND.
  bool drained() {
    const int64_t d = dropped.load(std::memory_order_acquire);
    return tail.load(std::memory_order_acquire) == head.load(std::memory_order_acquire) &&
           d <= at(ctrl, BEHIND).load(std::memory_order_acquire);
  }

  void loop() {
    for (;;) {
      const uint64_t t = tail.load(std::memory_order_relaxed);
      if (t != head.load(std::memory_order_acquire)) {
        const uint64_t i = t % uint64_t(cap);
        copy_job(entries[i], &pairs[i * max_pairs * 2]);
        tail.store(t + 1, std::memory_order_release);  // the entry is the worker's again
        continue;
      }
      // `dropped` first: the pushes before its drop are then seen, and done when head == t.
      const int64_t d = dropped.load(std::memory_order_acquire);
      if (head.load(std::memory_order_acquire) != t) continue;
      if (d > at(ctrl, BEHIND).load(std::memory_order_relaxed))
        at(ctrl, BEHIND).store(d, std::memory_order_release);
      if (stop.load(std::memory_order_acquire)) return;  // after the queued copies
      std::unique_lock<std::mutex> lock(mu);
      cv.wait_for(lock, std::chrono::milliseconds(1), [&] {
        return stop.load() || head.load(std::memory_order_acquire) != t;
      });
    }
  }
};

}  // namespace

extern "C" {

// A copier for a worker's pool w13 [N, 2I, H], w2 [N, H, I] (elem bytes a weight) and jobs of
// up to max_pairs pairs; its ring holds `ring` jobs. Its thread starts with the first
// configuration (ft_copier_configure).
void* ft_copier_new(int64_t* ctrl, const void* w13, const void* w2, int64_t elem, int64_t H,
                    int64_t I, int64_t max_pairs, int64_t ring) {
  if (ring < 1 || max_pairs < 1) return nullptr;
  auto* c = new Copier();
  c->ctrl = ctrl;
  c->w13 = static_cast<const char*>(w13);
  c->w2 = static_cast<const char*>(w2);
  c->elem = elem, c->H = H, c->I = I, c->max_pairs = max_pairs, c->cap = ring;
  c->entries.resize(size_t(ring));
  c->pairs.resize(size_t(ring * max_pairs * 2));  // no allocation per job
  c->fills.reserve(size_t(max_pairs));
  return c;
}

// The worker, before ANSWER: storage for the next job's pairs [max_pairs, 2] (lid, slot), or
// null when the ring is full (then ft_copier_drop, never a wait).
int64_t* ft_copier_begin(void* handle) {
  auto* c = static_cast<Copier*>(handle);
  const uint64_t h = c->head.load(std::memory_order_relaxed);  // the worker's own
  if (h - c->tail.load(std::memory_order_acquire) >= uint64_t(c->cap)) return nullptr;
  return &c->pairs[(h % uint64_t(c->cap)) * c->max_pairs * 2];
}

// The worker, after ANSWER: the job begun holds n pairs of columns [c0, c1); the copier wakes.
void ft_copier_push(void* handle, int64_t seq, int64_t c0, int64_t c1, int64_t n) {
  auto* c = static_cast<Copier*>(handle);
  const uint64_t h = c->head.load(std::memory_order_relaxed);
  c->entries[h % uint64_t(c->cap)] = Entry{seq, c0, c1, n};
  c->head.store(h + 1, std::memory_order_release);
  // Taken and let go: the copier is before its check of head or in its wait, so the notify is
  // not lost (it holds mu only for that check, never over copies).
  { std::lock_guard<std::mutex> lock(c->mu); }
  c->cv.notify_one();
}

// The worker, after ANSWER, when ft_copier_begin found the ring full: a job with n > 0 pairs
// loses its copies (BEHIND_ERROR DROPPED); BEHIND reaches seq once the ring is empty.
void ft_copier_drop(void* handle, int64_t seq, int64_t n) {
  auto* c = static_cast<Copier*>(handle);
  if (n > 0) at(c->ctrl, BEHIND_ERROR).store(DROPPED, std::memory_order_relaxed);
  c->dropped.store(seq, std::memory_order_release);
}

// The configuration (ft_worker_set_behind has its arguments; w13 null: off). Waits until the
// jobs queued under the previous one are copied; enabling from off stores BEHIND = ANSWER (the
// jobs before had no copies behind: a drain must not wait for theirs). Returns 0, or -1 (and
// changes nothing) when the arguments are invalid.
int ft_copier_configure(void* handle, void* w13, void* w2, int64_t slots, int64_t w13_stride,
                        int64_t w2_stride, int64_t* landed, int64_t* landed_src, void* ctx,
                        void* stream, void* set_current, void* htod, void* copy2d) {
  auto* c = static_cast<Copier*>(handle);
  std::unique_ptr<Behind> b;
  if (w13) {
    if (!w2 || !landed || slots < 1 || w13_stride < 0 || w2_stride < 0) return -1;
    if (ctx && (!landed_src || !set_current || !htod || !copy2d)) return -1;
    const int64_t e = c->elem;
    b.reset(new Behind{static_cast<char*>(w13), static_cast<char*>(w2), slots, w13_stride * e,
                       w2_stride * e, landed, landed_src, ctx, stream,
                       reinterpret_cast<CuCtxSetCurrent>(set_current),
                       reinterpret_cast<CuMemcpyHtoDAsync>(htod),
                       reinterpret_cast<CuMemcpy2DAsync>(copy2d)});
  }
  while (c->thread.joinable() && !c->drained())
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  std::lock_guard<std::mutex> lock(c->config_mu);
  if (b && !c->behind)
    at(c->ctrl, BEHIND).store(at(c->ctrl, ANSWER).load(std::memory_order_relaxed),
                              std::memory_order_release);
  c->behind = std::move(b);
  if (c->behind && !c->thread.joinable()) {
    c->thread = std::thread([c] { c->loop(); });
    pthread_setname_np(c->thread.native_handle(), "ft-copier");  // for top -H and the tests
  }
  return 0;
}

// After the worker's thread has stopped: the queued copies are made, then the thread joins.
void ft_copier_stop(void* handle) {
  auto* c = static_cast<Copier*>(handle);
  {
    std::lock_guard<std::mutex> lock(c->mu);
    c->stop.store(true);
  }
  c->cv.notify_one();
  if (c->thread.joinable()) c->thread.join();
  delete c;
}

}  // extern "C"
