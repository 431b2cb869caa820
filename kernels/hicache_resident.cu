// Resident copies: a few CTAs stay on the GPU and take transfers from a queue.
//
// Why: beside a saturating matmul, a launched copy kernel waits for SMs at
// every launch and moves about a fifth of the link; CTAs that are already
// resident keep most of their rate (docs/BENCHMARKS.md, "Transfers under
// compute"). So the copy loops of hicache_copy.cuh run here inside one
// long-lived kernel, and a transfer is a queue entry instead of a launch.
//
// The queue, for transfer number `seq` (1, 2, ...) in slot seq % queue:
//   host   writes the entry (KernelParams and friends) into mapped host memory,
//          then enqueues on the caller's stream S
//            cuStreamWriteValue64(go[slot] = seq)        after S's earlier work
//            cuStreamWaitValue64(done >= seq)            before S's later work
//          Stream memory operations run in the GPU's front end, not on SMs,
//          so neither waits for the matmul.
//   kernel every CTA waits for go[slot] == seq, copies its share, arrives on
//          arrive[slot]; the last CTA to arrive publishes done = seq (device
//          memory, for the streams) and a copy in host memory (for the host,
//          which reuses a slot only after its previous transfer finished).
//
// Lifetime: block 0 exits the kernel after idle_ns without work, so a
// device-wide synchronize (which waits for every kernel) returns at most that
// much later. The exit races with a submit, so both sides use a store-fence-
// load handshake (Dekker's): the host stores `submitted` and then reads
// `state`; the kernel stores state = EXITING and then reads `submitted`. At
// least one side sees the other's store: either the kernel stays, or the host
// sees EXITING/EXITED and launches a new instance (same stream, so it starts
// after the old one has fully exited, at seq = done + 1).

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <new>
#include <thread>

#include "hicache_copy.cuh"
#include "hicache_transfer.h"

namespace {

constexpr int kMaxQueue = 256;
constexpr uint32_t kRunning = 0, kExiting = 1, kExited = 2;

// One queue entry. Written by the host, read by every CTA into shared memory.
struct ResidentEntry {
  KernelParams params;
  int32_t method;       // HICACHE_METHOD_PLAIN or _BULK
  int32_t index_bytes;  // 4 or 8
  int32_t blocks;       // CTAs that copy (the others only arrive)
  int32_t warps;        // bulk copies: warps per CTA
};
static_assert(sizeof(ResidentEntry) % 4 == 0, "entries are read as 32-bit words");

// Mapped host memory: what the host reads, and the handshake words.
struct HostWords {
  uint64_t submitted;  // the last seq handed to a stream (host writes)
  uint64_t done;       // the last seq finished (kernel writes)
  uint32_t state;      // kRunning / kExiting / kExited (both write)
  uint32_t pad;
};

// Device memory: what the kernel polls and the streams wait on.
struct DeviceWords {
  uint64_t done;
  uint32_t quit_epoch;  // instances with epoch <= this exit (block 0 tells the others)
  uint32_t stop;        // set by hicache_resident_destroy
  uint64_t go[kMaxQueue];
  uint32_t arrive[kMaxQueue];
};

struct ResidentArgs {
  const ResidentEntry* entries;  // mapped host memory
  HostWords* host;               // mapped host memory
  DeviceWords* dev;
  uint32_t queue;
  uint32_t epoch;
  uint64_t idle_ns;
};

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

template <typename T>
__device__ __forceinline__ T load_volatile(const T& x) {
  return *const_cast<const volatile T*>(&x);
}

template <typename T>
__device__ __forceinline__ void store_volatile(T& x, T v) {
  *const_cast<volatile T*>(&x) = v;
}

__device__ __forceinline__ void release_fence_system() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 700
  asm volatile("fence.acq_rel.sys;" ::: "memory");
#else
  __threadfence_system();
#endif
}

// Block 0, idle: try to exit. False when a submit raced in (then stay).
__device__ bool try_exit(const ResidentArgs& a, uint64_t seq) {
  store_volatile(a.host->state, kExiting);
  __threadfence_system();
  if (load_volatile(a.host->submitted) >= seq) {
    store_volatile(a.host->state, kRunning);
    return false;
  }
  store_volatile(a.dev->quit_epoch, a.epoch);  // before kExited: a new instance's epoch is above it
  __threadfence_system();
  store_volatile(a.host->state, kExited);
  return true;
}

__device__ void copy_entry(const ResidentEntry& e, unsigned char* smem) {
  if (blockIdx.x >= static_cast<uint32_t>(e.blocks)) return;
  const KernelParams& p = e.params;
  if (e.method == HICACHE_METHOD_BULK) {
    if (threadIdx.x >= static_cast<uint32_t>(e.warps) * kBulkLanes) return;
    if (e.index_bytes == 4) {
      bulk_rows<int32_t>(p, blockIdx.x, e.blocks, e.warps, smem);
    } else {
      bulk_rows<int64_t>(p, blockIdx.x, e.blocks, e.warps, smem);
    }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.global;" ::: "memory");  // bulk stores before the generic-proxy fence below
#endif
    return;
  }
  // 16-byte vectors only: rows and strides that are not multiples of 16 bytes are launched as usual
  // (hicache_resident_submit), which keeps this kernel, and the library every process loads, small.
  if (e.index_bytes == 8) {
    plain_rows<int64_t, 16>(p, blockIdx.x, e.blocks);
  } else {
    plain_rows<int32_t, 16>(p, blockIdx.x, e.blocks);
  }
}

__global__ void __launch_bounds__(kPlainThreads, 1) resident_loop(const ResidentArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ ResidentEntry entry;
  __shared__ int action;  // 1: copy the entry, 2: exit
  uint64_t seq = load_volatile(a.dev->done) + 1;
  uint64_t idle_since = now_ns();
  for (;;) {
    const uint32_t slot = static_cast<uint32_t>(seq % a.queue);
    if (threadIdx.x == 0) {
      uint32_t nap = 64;
      int act = 0;
      while (act == 0) {
        if (load_volatile(a.dev->go[slot]) == seq) {
          // The entry is released; an instance told to quit leaves it to the next one.
          act = load_volatile(a.dev->quit_epoch) >= a.epoch ? 2 : 1;
        } else if (load_volatile(a.dev->quit_epoch) >= a.epoch || load_volatile(a.dev->stop)) {
          act = 2;
        } else if (blockIdx.x == 0 && now_ns() - idle_since > a.idle_ns) {
          if (try_exit(a, seq)) act = 2;
          idle_since = now_ns();
        } else {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
          __nanosleep(nap);  // back off while idle; 0.5 us at most added to a transfer's start
#endif
          if (nap < 512) nap *= 2;
        }
      }
      action = act;
    }
    __syncthreads();
    if (action == 2) return;
    const uint32_t* from = reinterpret_cast<const uint32_t*>(&a.entries[slot]);
    uint32_t* to = reinterpret_cast<uint32_t*>(&entry);
    for (uint32_t i = threadIdx.x; i < sizeof(ResidentEntry) / 4; i += blockDim.x) to[i] = load_volatile(from[i]);
    __syncthreads();
    copy_entry(entry, smem);
    __syncthreads();
    if (threadIdx.x == 0) {
      // One release fence per CTA, after the barrier, orders every thread's copies before the arrival
      // (fences are cumulative), as a grid-wide sync does. A fence per thread, and sequentially
      // consistent ones, cost the matmul beside us far more (docs/BENCHMARKS.md).
      release_fence_system();
      if (atomicAdd(&a.dev->arrive[slot], 1u) == gridDim.x - 1) {
        atomicExch(&a.dev->arrive[slot], 0u);
        release_fence_system();
        store_volatile(a.host->done, seq);
        store_volatile(a.dev->done, seq);
      }
    }
    idle_since = now_ns();
    ++seq;
  }
}

using WriteValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WaitValue64 = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WriteValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
using GetAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);

template <typename F>
F driver_entry(const char* name) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found;
  if (cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) != cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<F>(fn);
}

}  // namespace

struct HicacheResident {
  int device = 0;
  int blocks = 0;
  uint32_t queue = 0;
  uint64_t idle_ns = 0;
  cudaStream_t stream = nullptr;  // runs the kernel
  cudaStream_t side = nullptr;    // the stop signal
  ResidentEntry* entries = nullptr;
  HostWords* host = nullptr;
  DeviceWords* dev = nullptr;
  size_t smem = 0;                // dynamic shared memory per resident CTA
  bool bulk_capable = false;
  WriteValue64 write64 = nullptr;
  WaitValue64 wait64 = nullptr;
  WriteValue32 write32 = nullptr;
  std::mutex mu;
  uint64_t next_seq = 1;
  uint32_t epoch = 0;
  uint64_t stats[4] = {0, 0, 0, 0};
};

namespace {

int ensure_running(HicacheResident* r) {
  volatile uint32_t* state = &r->host->state;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  uint32_t s = *state;
  while (s == kExiting) {  // block 0 decides within a PCIe round trip
    if (std::chrono::steady_clock::now() > deadline) return kErrResidentStuck;
    std::this_thread::yield();
    s = *state;
  }
  if (s == kRunning) return 0;
  *state = kRunning;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  ResidentArgs a{r->entries, r->host, r->dev, r->queue, ++r->epoch, r->idle_ns};
  resident_loop<<<r->blocks, kPlainThreads, r->smem, r->stream>>>(a);
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    *state = kExited;
    return err;
  }
  ++r->stats[0];
  return 0;
}

// An ordinary launch on the caller's stream, for what the queue does not take.
int fall_back(HicacheResident* r, const HicacheTransfer* t, void* stream, int* method_used) {
  ++r->stats[2];
  return hicache_transfer_launch(t, stream, method_used);
}

void release(HicacheResident* r) {
  if (r->stream) cudaStreamDestroy(r->stream);
  if (r->side) cudaStreamDestroy(r->side);
  if (r->entries) cudaFreeHost(r->entries);
  if (r->host) cudaFreeHost(r->host);
  if (r->dev) cudaFree(r->dev);
  delete r;
}

}  // namespace

extern "C" int hicache_resident_create(int blocks, int queue_slots, int64_t idle_us, HicacheResident** out) {
  if (out == nullptr || queue_slots < 1 || queue_slots > kMaxQueue || idle_us < 0) return kErrInvalid;
  *out = nullptr;
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device)) return err;
  int sms = 0, major = 0, max_smem = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (!err) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (!err) err = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err) return err;
  if (blocks < 1 || blocks > sms) return kErrInvalid;  // every CTA must be able to stay resident at once

  HicacheResident* r = new (std::nothrow) HicacheResident;
  if (r == nullptr) return cudaErrorMemoryAllocation;
  r->device = device;
  r->blocks = blocks;
  r->queue = static_cast<uint32_t>(queue_slots);
  r->idle_ns = static_cast<uint64_t>(idle_us) * 1000;
  r->write64 = driver_entry<WriteValue64>("cuStreamWriteValue64");
  r->wait64 = driver_entry<WaitValue64>("cuStreamWaitValue64");
  r->write32 = driver_entry<WriteValue32>("cuStreamWriteValue32");
  const GetAttribute get_attribute = driver_entry<GetAttribute>("cuDeviceGetAttribute");
  int mem_ops = 0;
  if (!r->write64 || !r->wait64 || !r->write32 || !get_attribute ||
      get_attribute(&mem_ops, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device) != CUDA_SUCCESS ||
      !mem_ops) {
    release(r);
    return kErrNoStreamMemOps;
  }
  cudaFuncAttributes attr;
  err = cudaFuncGetAttributes(&attr, resident_loop);
  if (!err) {
    r->smem = static_cast<size_t>(max_smem) - attr.sharedSizeBytes;
    r->bulk_capable = major >= 9 && attr.binaryVersion >= 90;
    err = cudaFuncSetAttribute(resident_loop, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(r->smem));
  }
  int least = 0, greatest = 0;
  if (!err) err = cudaDeviceGetStreamPriorityRange(&least, &greatest);
  // Highest priority: when SMs free up, the block scheduler places these CTAs first.
  if (!err) err = cudaStreamCreateWithPriority(&r->stream, cudaStreamNonBlocking, greatest);
  if (!err) err = cudaStreamCreateWithFlags(&r->side, cudaStreamNonBlocking);
  void* entries = nullptr;
  void* host = nullptr;
  if (!err) err = cudaHostAlloc(&entries, sizeof(ResidentEntry) * r->queue, cudaHostAllocMapped | cudaHostAllocPortable);
  if (!err) r->entries = static_cast<ResidentEntry*>(entries);
  if (!err) err = cudaHostAlloc(&host, sizeof(HostWords), cudaHostAllocMapped | cudaHostAllocPortable);
  if (!err) r->host = static_cast<HostWords*>(host);
  if (!err) err = cudaMalloc(&r->dev, sizeof(DeviceWords));
  if (!err) err = cudaMemsetAsync(r->dev, 0, sizeof(DeviceWords), r->side);
  if (!err) err = cudaStreamSynchronize(r->side);
  if (err) {
    cudaGetLastError();
    release(r);
    return err;
  }
  *r->host = HostWords{0, 0, kExited, 0};
  *out = r;
  return 0;
}

extern "C" int hicache_resident_submit(HicacheResident* r, const HicacheTransfer* t, void* stream,
                                       int* method_used) {
  if (r == nullptr || t == nullptr) return kErrInvalid;
  if (const int err = validate(*t)) return err;
  const int method = resolve_method(*t, r->bulk_capable, static_cast<int64_t>(r->smem));
  if (method_used != nullptr) *method_used = method;
  if (t->num_items == 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (const cudaError_t err = cudaStreamIsCapturing(s, &capture)) return err;
  // A graph replays what was captured, not a queue entry: capture an ordinary launch. Live pointer
  // tables are compared by each CTA of an ordinary launch before it copies (tables_stale).
  if (capture != cudaStreamCaptureStatusNone || t->src_live[0] || t->src_live[1] || t->dst_live[0] ||
      t->dst_live[1]) {
    return fall_back(r, t, stream, method_used);
  }
  if (t->num_items > kMaxWork / work_per_item(*t, method) || vector_width(*t) != 16) {
    return fall_back(r, t, stream, method_used);
  }

  std::lock_guard<std::mutex> lock(r->mu);
  const uint64_t seq = r->next_seq;
  const uint32_t slot = static_cast<uint32_t>(seq % r->queue);
  // The slot's previous transfer has not finished (its stream may not have reached it): never wait for it here.
  if (seq > r->queue && *static_cast<volatile uint64_t*>(&r->host->done) < seq - r->queue) {
    return fall_back(r, t, stream, method_used);
  }
  const BulkShape bulk = bulk_shape(*t, static_cast<int64_t>(r->smem));
  ResidentEntry& e = r->entries[slot];
  e.params = plan_params(*t, method, bulk);
  if (t->index_bytes == 4) {
    set_item_range<int32_t>(e.params, *t, method, 0, t->num_items);
  } else {
    set_item_range<int64_t>(e.params, *t, method, 0, t->num_items);
  }
  e.method = method;
  e.index_bytes = t->index_bytes;
  e.warps = static_cast<int32_t>(bulk.warps);
  const int64_t quota = t->num_blocks > 0 && t->num_blocks < r->blocks ? t->num_blocks : r->blocks;
  const int64_t per_block = method == HICACHE_METHOD_BULK ? int64_t{kBulkLanes} * bulk.warps
                                                          : int64_t{kPlainThreads} * kPlainUnroll;
  const int64_t needed = (int64_t{e.params.total_vecs} + per_block - 1) / per_block;
  e.blocks = static_cast<int32_t>(needed < quota ? needed : quota);
  // The entry is in memory before `submitted` says it exists and before any stream can release it.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  *static_cast<volatile uint64_t*>(&r->host->submitted) = seq;
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (const int err = ensure_running(r)) return err;

  const CUstream cu = reinterpret_cast<CUstream>(s);
  const CUdeviceptr go = reinterpret_cast<CUdeviceptr>(&r->dev->go[slot]);
  const CUdeviceptr done = reinterpret_cast<CUdeviceptr>(&r->dev->done);
  if (r->write64(cu, go, seq, CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS) {
    return fall_back(r, t, stream, method_used);  // nothing was enqueued: seq is handed out again
  }
  r->next_seq = seq + 1;
  ++r->stats[1];
  if (r->wait64(cu, done, seq, CU_STREAM_WAIT_VALUE_GEQ) != CUDA_SUCCESS) {
    // The copy will run but the stream would not wait for it: wait here instead.
    while (*static_cast<volatile uint64_t*>(&r->host->done) < seq) std::this_thread::yield();
  }
  if (method_used != nullptr) *method_used = method | HICACHE_RESIDENT_QUEUED;
  return 0;
}

extern "C" void hicache_resident_stats(const HicacheResident* r, uint64_t out[4]) {
  if (r == nullptr || out == nullptr) return;
  out[0] = r->stats[0];
  out[1] = r->stats[1];
  out[2] = r->stats[2];
  out[3] = *static_cast<const volatile uint64_t*>(&r->host->done);
}

extern "C" int hicache_resident_destroy(HicacheResident* r, int64_t timeout_ms) {
  if (r == nullptr) return 0;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(r->device);
  {
    std::lock_guard<std::mutex> lock(r->mu);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (*static_cast<volatile uint64_t*>(&r->host->done) + 1 < r->next_seq &&
           std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    r->write32(reinterpret_cast<CUstream>(r->side), reinterpret_cast<CUdeviceptr>(&r->dev->stop), 1,
               CU_STREAM_WRITE_VALUE_DEFAULT);
  }
  const cudaError_t err = cudaStreamSynchronize(r->stream);
  release(r);
  cudaSetDevice(previous);
  return err;
}
