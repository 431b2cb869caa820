// Device-side row copies and the host-side planning both launch paths share:
// hicache_transfer.cu launches them as ordinary kernels, hicache_resident.cu
// runs them inside a resident kernel fed by a queue. Included by both .cu
// files (each gets its own copy: everything here has internal linkage).
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "hicache_transfer.h"

namespace {


constexpr int kPlainThreads = 512;
constexpr int kPlainUnroll = 8;
constexpr int kBulkLanes = 32;       // rows per chunk: one per lane of the warp
constexpr int kBulkMaxStages = 32;   // one mbarrier per lane at most
constexpr int kBulkBarrierBytes = 256;  // kBulkMaxStages mbarriers, 8 bytes each, per warp
constexpr int kBulkMaxWarps = 8;
// Defaults measured on an H200 (docs/BENCHMARKS.md): 128-byte aligned reads
// (656-byte rows: 0.45 -> 0.79 of the link), as many warps as fit two stages
// of shared memory (256-byte rows: 0.41 -> 0.80 from 2 to 4+ warps), 4 CTAs
// for the bulk engine and 8 for plain loads and stores, which need more SMs
// to keep enough requests in flight.
constexpr int kDefaultReadAlign = 128;
constexpr int kMinBulkStages = 2;
constexpr int kDefaultBulkBlocks = 4;
constexpr int kDefaultPlainBlocks = 8;
constexpr int64_t kMaxWork = (int64_t{1} << 31) - 1;  // 32-bit work counters

// Exact n / d for 0 <= n < 2^31 and 1 <= d < 2^31 with a multiply and a
// shift: integer division would cost more than the copy itself per 16 bytes.
struct FastDiv {
  uint32_t divisor, multiplier, shift;

  static FastDiv make(uint32_t d) {
    FastDiv f{d, 0, 0};
    if (d > 1) {
      uint32_t log2_ceil = 0;
      while ((uint64_t{1} << log2_ceil) < d) ++log2_ceil;
      const uint32_t p = 31 + log2_ceil;
      f.multiplier = static_cast<uint32_t>(((uint64_t{1} << p) + d - 1) / d);
      f.shift = p - 32;
    }
    return f;
  }

  __device__ __forceinline__ void divmod(uint32_t n, uint32_t& q, uint32_t& r) const {
    q = divisor == 1 ? n : (__umulhi(n, multiplier) >> shift);
    r = n - q * divisor;
  }
};

struct KernelParams {
  HicacheTransfer t;
  FastDiv planes;        // rows per item: num_caches * num_layers
  FastDiv layers;        // num_layers
  FastDiv vecs_per_row;  // plain kernel: row_bytes / vector width
  uint32_t num_rows;     // num_items * planes (< 2^31)
  uint32_t total_vecs;   // plain kernel: num_rows * vecs_per_row (< 2^31)
  uint32_t bulk_stages;  // bulk kernel: chunks of 32 rows in flight per warp
  uint32_t bulk_slot_bytes;  // shared memory per row: the row plus alignment slack
  uint32_t read_align;
  uint32_t bulk_eager;       // bulk kernel: refill a stage as soon as its store has read it
};

__device__ __forceinline__ void report(const HicacheTransfer& t, int word) {
  if (t.error_flags != nullptr) reinterpret_cast<volatile uint32_t*>(t.error_flags)[word] = 1;
}

// Whether a caller's pointer table (src_live/dst_live) differs from the checked copy the rows are
// placed through. Every thread of the CTA must call it (a barrier); the answer is the CTA's. Without
// live tables it returns false at once (a branch uniform across the grid).
__device__ __forceinline__ bool tables_stale(const HicacheTransfer& t) {
  if (!(t.src_live[0] || t.src_live[1] || t.dst_live[0] || t.dst_live[1])) return false;
  const int layers = t.num_layers;
  int stale = 0;
  for (int i = threadIdx.x; i < 4 * layers; i += blockDim.x) {
    const int which = i / layers, layer = i % layers;  // 0, 1: the source's caches; 2, 3: the destination's
    const uint64_t* live = which < 2 ? t.src_live[which] : t.dst_live[which - 2];
    const uint64_t* kept = which < 2 ? t.src_tables[which] : t.dst_tables[which - 2];
    if (live != nullptr && kept != nullptr && (which & 1) < t.num_caches) {
      stale |= *reinterpret_cast<const volatile uint64_t*>(live + layer) != kept[layer];
    }
  }
  stale = __syncthreads_or(stale);
  if (stale && threadIdx.x == 0) report(t, HICACHE_ERR_STALE_TABLE);
  return stale != 0;
}

template <typename Index>
__device__ __forceinline__ int64_t load_index(const void* indices, uint32_t i) {
  return static_cast<int64_t>(__ldg(static_cast<const Index*>(indices) + i));
}

// What a flattened row's addresses depend on: its two indices and the two
// layer bases. fetch_row issues every load without using any result, so a
// thread can start the loads of several rows before it waits for the first.
struct RowRef {
  int64_t si, di;
  uint64_t src_base, dst_base;
};

template <typename Index>
__device__ __forceinline__ RowRef fetch_row(const KernelParams& p, uint32_t row) {
  const HicacheTransfer& t = p.t;
  uint32_t item, plane, cache, layer;
  p.planes.divmod(row, item, plane);
  p.layers.divmod(plane, cache, layer);
  const uint64_t* src_table = cache ? t.src_tables[1] : t.src_tables[0];
  const uint64_t* dst_table = cache ? t.dst_tables[1] : t.dst_tables[0];
  RowRef r;
  r.si = load_index<Index>(t.indices_src, item);
  r.di = load_index<Index>(t.indices_dst, item);
  r.src_base = src_table ? __ldg(src_table + layer) : (cache ? t.src_bases[1] : t.src_bases[0]);
  r.dst_base = dst_table ? __ldg(dst_table + layer) : (cache ? t.dst_bases[1] : t.dst_bases[0]);
  return r;
}

// Source and destination addresses of a fetched row, or false when the row is
// skipped (negative index) or refused (index out of range).
__device__ __forceinline__ bool place_row(const KernelParams& p, const RowRef& r, const char*& src, char*& dst) {
  const HicacheTransfer& t = p.t;
  if (r.si < 0 || r.di < 0) return false;
  if (t.src_rows >= 0 && r.si >= t.src_rows) {
    report(t, HICACHE_ERR_SRC_INDEX);
    return false;
  }
  if (t.dst_rows >= 0 && r.di >= t.dst_rows) {
    report(t, HICACHE_ERR_DST_INDEX);
    return false;
  }
  src = reinterpret_cast<const char*>(r.src_base + static_cast<uint64_t>(r.si * t.src_stride));
  dst = reinterpret_cast<char*>(r.dst_base + static_cast<uint64_t>(r.di * t.dst_stride));
  return true;
}

// Word-by-word copy for rows whose addresses miss the vector alignment (only
// reachable through raw pointer tables; tensors are checked in Python).
__device__ __noinline__ void copy_words(const HicacheTransfer& t, const char* src, char* dst,
                                        uint32_t bytes) {
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 3) != 0) {
    report(t, HICACHE_ERR_MISALIGNED);
    return;
  }
  for (uint32_t i = 0; i < bytes; i += 4) {
    *reinterpret_cast<uint32_t*>(dst + i) = *reinterpret_cast<const uint32_t*>(src + i);
  }
}

template <int kVec> struct VecOf;
template <> struct VecOf<4> { using type = uint32_t; };
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<16> { using type = uint4; };

// Work item e covers bytes [vec * kVec, (vec + 1) * kVec) of flattened row
// `row`. Each warp takes a contiguous span of 32 * kPlainUnroll items per
// pass, consecutive lanes consecutive items: a warp reads and writes whole
// rows in address order, one 32-item stretch per unrolled step.
// CTA `block` of `blocks` copies its share; called by a kernel of kPlainThreads threads.
template <typename Index, int kVec>
__device__ __forceinline__ void plain_rows(const KernelParams& p, uint32_t block, uint32_t blocks) {
  using V = typename VecOf<kVec>::type;
  constexpr uint32_t kWarpSpan = 32 * kPlainUnroll;
  const uint32_t total = p.total_vecs;
  const uint32_t step = blocks * kPlainThreads * kPlainUnroll;
  for (uint32_t base = block * kPlainThreads * kPlainUnroll + threadIdx.x / 32 * kWarpSpan + threadIdx.x % 32;
       base < total; base += step) {
    // Three passes, so each waits once: the rows' indices and layer bases
    // (all loads issued before any is used), then the data loads, then the
    // stores. Folding the first two into one loop would wait for each
    // element's indices before issuing its data load.
    RowRef ref[kPlainUnroll];
    uint32_t offset[kPlainUnroll];
#pragma unroll
    for (int u = 0; u < kPlainUnroll; ++u) {
      const uint32_t e = base + u * 32;
      uint32_t row, vec;
      p.vecs_per_row.divmod(e < total ? e : total - 1, row, vec);  // past the end: a real row, never copied
      ref[u] = fetch_row<Index>(p, row);
      offset[u] = vec * kVec;
    }
    V data[kPlainUnroll];
    V* dst[kPlainUnroll];
#pragma unroll
    for (int u = 0; u < kPlainUnroll; ++u) {
      dst[u] = nullptr;
      const char* s;
      char* d;
      if (base + u * 32 >= total || !place_row(p, ref[u], s, d)) continue;
      s += offset[u];
      d += offset[u];
      if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d)) & (kVec - 1)) == 0) {
        data[u] = __ldg(reinterpret_cast<const V*>(s));
        dst[u] = reinterpret_cast<V*>(d);
      } else {
        copy_words(p.t, s, d, kVec);
      }
    }
#pragma unroll
    for (int u = 0; u < kPlainUnroll; ++u) {
      if (dst[u] != nullptr) *dst[u] = data[u];
    }
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}

// Before the barrier's memory is used for anything else (the resident kernel
// reuses shared memory with another layout for its next transfer).
__device__ __forceinline__ void mbar_inval(uint64_t* bar) {
  asm volatile("mbarrier.inval.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bulk_load(void* smem_dst, const void* global_src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(smem_dst)),
      "l"(global_src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ void bulk_store(void* global_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(global_dst),
               "r"(smem_addr(smem_src)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Waits until at most one committed bulk store of this thread still reads
// shared memory.
__device__ __forceinline__ void bulk_wait_read_all_but_one() {
  asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
}

__device__ __forceinline__ void bulk_wait_read_all() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }

__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }
#endif

// Each warp runs its own pipeline over chunks of 32 consecutive flattened
// rows, lane i owning row i of a chunk and its shared-memory slot in stage
// k % stages. A stage goes: bulk load (source -> shared, completing on the
// stage's mbarrier) -> bulk store (shared -> destination) -> refill with
// chunk k + stages once the store has read the slot.
//
// Loads read whole read_align-byte spans around the row when they stay inside
// the source pool: PCIe moves aligned lines much better than ragged ones (656
// and 576-byte rows start mid-line), and the store then picks the row out.
//
// CTA `block` of `blocks` runs pipelines for its first `warps` warps (the
// caller keeps other warps out), staging through `smem` (128-byte aligned).
template <typename Index>
__device__ __forceinline__ void bulk_rows(const KernelParams& p, uint32_t block, uint32_t blocks, uint32_t warps,
                                          unsigned char* smem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const uint32_t lane = threadIdx.x % kBulkLanes;
  const uint32_t warp = threadIdx.x / kBulkLanes;
  const uint32_t stages = p.bulk_stages;
  const uint32_t slot_bytes = p.bulk_slot_bytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * kBulkMaxStages;
  unsigned char* slots = smem + kBulkBarrierBytes * warps + size_t{warp} * stages * kBulkLanes * slot_bytes;
  const uint32_t row_bytes = static_cast<uint32_t>(p.t.row_bytes);
  const uint64_t align_mask = static_cast<uint64_t>(p.read_align) - 1;
  // Bytes from a row's base to the end of the last row of its pool, or 0 when the pool size is unknown.
  const uint64_t pool_span =
      p.t.src_rows > 0 ? static_cast<uint64_t>((p.t.src_rows - 1) * p.t.src_stride + p.t.row_bytes) : 0;
  const uint32_t num_chunks = (p.num_rows + kBulkLanes - 1) / kBulkLanes;
  const uint32_t pipe = block * warps + warp;  // this warp's pipeline
  const uint32_t pipes = blocks * warps;
  if (pipe >= num_chunks) return;
  const uint32_t my_chunks = (num_chunks - pipe + pipes - 1) / pipes;

  if (lane < stages) mbar_init(&bars[lane], 1);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();

  auto slot = [&](uint32_t stage) { return slots + (stage * kBulkLanes + lane) * slot_bytes; };
  // This lane's row of chunk k. bulk: it goes through the bulk engine (16-byte
  // aligned); otherwise it is skipped or, with copy_misaligned, copied word by
  // word. [lo, hi) is the span the load reads.
  struct Row {
    const char* s;
    char* d;
    uint64_t lo, hi;
    bool bulk;
  };
  auto locate = [&](uint32_t k, bool copy_misaligned) {
    Row r{nullptr, nullptr, 0, 0, false};
    const uint32_t row = (pipe + k * pipes) * kBulkLanes + lane;
    if (row >= p.num_rows) return r;
    const RowRef ref = fetch_row<Index>(p, row);
    if (!place_row(p, ref, r.s, r.d)) return r;
    const uint64_t base = ref.src_base;
    if (((reinterpret_cast<uintptr_t>(r.s) | reinterpret_cast<uintptr_t>(r.d)) & 15) != 0) {
      if (copy_misaligned) copy_words(p.t, r.s, r.d, row_bytes);
      return r;
    }
    r.bulk = true;
    r.lo = reinterpret_cast<uint64_t>(r.s);
    r.hi = r.lo + row_bytes;
    if (pool_span != 0) {  // widen to aligned lines, clamped to the pool: never before its first row or past its last
      const uint64_t wide_lo = r.lo & ~align_mask, wide_hi = (r.hi + align_mask) & ~align_mask;
      r.lo = wide_lo > base ? wide_lo : base;
      r.hi = wide_hi < base + pool_span ? wide_hi : base + pool_span;
    }
    return r;
  };
  auto issue_load = [&](uint32_t k, const Row& r) {
    const uint32_t stage = k % stages;
    const uint32_t bytes = r.bulk ? static_cast<uint32_t>(r.hi - r.lo) : 0;
    const uint32_t total = __reduce_add_sync(0xffffffffu, bytes);
    if (lane == 0) mbar_arrive_expect_tx(&bars[stage], total);
    if (r.bulk) bulk_load(slot(stage), reinterpret_cast<const void*>(r.lo), bytes, &bars[stage]);
  };

  const uint32_t prologue = my_chunks < stages ? my_chunks : stages;
  for (uint32_t k = 0; k < prologue; ++k) issue_load(k, locate(k, true));
  // Eager refill (destination in GPU memory): a stage is reloaded as soon as
  // its store has read it, which keeps `stages` loads in flight; with 1152-byte
  // rows (two stages) that took 4K-token loads from 0.77 to 0.90 of the link.
  // Lagged refill (stores to host memory) reloads the stage of chunk k - 1
  // after storing chunk k: one store stays in flight, which measured better
  // there, at the cost of one load in flight.
  const bool eager = p.bulk_eager != 0;
  for (uint32_t k = 0; k < my_chunks; ++k) {
    const uint32_t stage = k % stages;
    const uint32_t refill = eager ? k + stages : k - 1 + stages;
    const bool refilling = (eager || k >= 1) && refill < my_chunks;
    // The refill's indices are read before the wait, so their latency hides behind it.
    Row next{nullptr, nullptr, 0, 0, false};
    if (refilling) next = locate(refill, true);
    mbar_wait(&bars[stage], (k / stages) & 1);
    const Row cur = locate(k, false);
    if (cur.bulk) bulk_store(cur.d, slot(stage) + (reinterpret_cast<uint64_t>(cur.s) - cur.lo), row_bytes);
    bulk_commit();
    if (refilling) {
      if (eager) {
        bulk_wait_read_all();
      } else {
        bulk_wait_read_all_but_one();
      }
      issue_load(refill, next);
    }
  }
  bulk_wait_all();
  __syncwarp();
  if (lane < stages) mbar_inval(&bars[lane]);
#endif
}

constexpr int kErrInvalid = -1;
constexpr int kErrTooLarge = -2;
constexpr int kErrDevice = -3;
constexpr int kErrNoStreamMemOps = -4;
constexpr int kErrResidentStuck = -5;

inline int validate(const HicacheTransfer& t) {
  if (t.row_bytes <= 0 || t.row_bytes % 4 != 0) return kErrInvalid;
  if (t.num_caches < 1 || t.num_caches > 2 || t.num_layers < 1) return kErrInvalid;
  if (t.index_bytes != 4 && t.index_bytes != 8) return kErrInvalid;
  if (t.num_items < 0 || t.num_blocks < 0) return kErrInvalid;
  if (t.indices_src == nullptr || t.indices_dst == nullptr) return kErrInvalid;
  for (int c = 0; c < t.num_caches; ++c) {
    if (t.num_layers > 1 && (t.src_tables[c] == nullptr || t.dst_tables[c] == nullptr)) return kErrInvalid;
    if (t.src_tables[c] == nullptr && t.src_bases[c] == 0) return kErrInvalid;
    if (t.dst_tables[c] == nullptr && t.dst_bases[c] == 0) return kErrInvalid;
  }
  if (t.bulk_warps < 0 || t.bulk_warps > kBulkMaxWarps) return kErrInvalid;
  if (t.read_align != 0 && (t.read_align < 16 || t.read_align > 256 || (t.read_align & (t.read_align - 1)))) {
    return kErrInvalid;
  }
  const int64_t planes = int64_t{t.num_caches} * t.num_layers;
  if (planes * (t.row_bytes / 4) > kMaxWork || planes > kMaxWork) return kErrTooLarge;
  return 0;
}

inline int vector_width(const HicacheTransfer& t) {
  for (int w : {16, 8}) {
    if (t.row_bytes % w == 0 && t.src_stride % w == 0 && t.dst_stride % w == 0) return w;
  }
  return 4;
}

struct BulkShape {
  uint32_t warps, align, slot_bytes, stages;
  size_t smem;
};

// smem_budget: the dynamic shared memory one CTA may use.
inline BulkShape bulk_shape(const HicacheTransfer& t, int64_t smem_budget) {
  BulkShape b;
  b.align = t.read_align > 0 ? t.read_align : kDefaultReadAlign;
  const int64_t slot = (t.row_bytes + b.align - 16 + b.align - 1) / b.align * b.align;
  b.slot_bytes = static_cast<uint32_t>(slot);
  const int64_t per_warp_stage = int64_t{kBulkLanes} * slot + kBulkBarrierBytes / kMinBulkStages;
  const int64_t fit = smem_budget / (per_warp_stage * kMinBulkStages);
  const int64_t warps = t.bulk_warps > 0 ? t.bulk_warps : (fit < 1 ? 1 : (fit > kBulkMaxWarps ? kBulkMaxWarps : fit));
  b.warps = static_cast<uint32_t>(warps);
  const int64_t per_stage = int64_t{kBulkLanes} * slot * warps;
  const int64_t stages = (smem_budget - int64_t{kBulkBarrierBytes} * warps) / per_stage;
  b.stages = static_cast<uint32_t>(stages < 0 ? 0 : (stages < kBulkMaxStages ? stages : kBulkMaxStages));
  b.smem = size_t{kBulkBarrierBytes} * warps + size_t{b.stages} * per_stage;
  return b;
}

inline int resolve_method(const HicacheTransfer& t, bool bulk_capable, int64_t smem_budget) {
  const bool bulk_ok = bulk_capable && vector_width(t) == 16 && bulk_shape(t, smem_budget).stages >= kMinBulkStages;
  if (t.method == HICACHE_METHOD_BULK || t.method == HICACHE_METHOD_AUTO) {
    return bulk_ok ? HICACHE_METHOD_BULK : HICACHE_METHOD_PLAIN;
  }
  return HICACHE_METHOD_PLAIN;
}

// The part of KernelParams that depends only on the transfer and the method:
// everything but the item range (set per launch) and the bulk shape's fields.
inline KernelParams plan_params(const HicacheTransfer& t, int method, const BulkShape& bulk) {
  const int vec = method == HICACHE_METHOD_BULK ? 16 : vector_width(t);
  KernelParams p;
  p.t = t;
  const uint32_t planes = static_cast<uint32_t>(t.num_caches * t.num_layers);
  p.planes = FastDiv::make(planes);
  p.layers = FastDiv::make(static_cast<uint32_t>(t.num_layers));
  p.vecs_per_row = FastDiv::make(static_cast<uint32_t>(t.row_bytes / vec));
  p.num_rows = 0;
  p.total_vecs = 0;
  p.bulk_stages = bulk.stages;
  p.bulk_slot_bytes = bulk.slot_bytes;
  p.read_align = bulk.align;
  p.bulk_eager = (t.hints & HICACHE_HINT_DST_DEVICE) != 0;
  return p;
}

// Work units per item: rows for the bulk method, vectors for plain copies.
inline int64_t work_per_item(const HicacheTransfer& t, int method) {
  const int64_t planes = int64_t{t.num_caches} * t.num_layers;
  return method == HICACHE_METHOD_BULK ? planes : planes * (t.row_bytes / vector_width(t));
}

// Points p at items [start, start + n) of t.
template <typename Index>
inline void set_item_range(KernelParams& p, const HicacheTransfer& t, int method, int64_t start, int64_t n) {
  const int64_t planes = int64_t{t.num_caches} * t.num_layers;
  p.t.indices_src = static_cast<const Index*>(t.indices_src) + start;
  p.t.indices_dst = static_cast<const Index*>(t.indices_dst) + start;
  p.t.num_items = n;
  p.num_rows = static_cast<uint32_t>(n * planes);
  p.total_vecs = static_cast<uint32_t>(n * work_per_item(t, method));
}

}  // namespace
