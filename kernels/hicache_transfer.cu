// HiCache KV row copies between GPU memory and pinned host memory.
//
// Torch-free on purpose: this file includes only the CUDA runtime, so it
// compiles in about a second (torch/extension.h in a .cu file costs over a
// minute on a small machine). binding.cpp exposes the launcher to PyTorch.
//
// Two kernels, both gathering rows by index on either side:
//   copy_rows_plain  vectorized loads/stores from SM threads; any GPU, any row
//                    size that is a multiple of 4 bytes. Each thread keeps
//                    kPlainUnroll independent loads in flight, because a load
//                    from host memory waits a PCIe round trip (~1-2 us).
//   copy_rows_bulk   Hopper's bulk-copy engine (cp.async.bulk): one lane per
//                    row stages rows through shared memory, several chunks of
//                    32 rows deep, so a handful of CTAs keeps the link busy.
//                    Needs sm_90+, 16-byte aligned rows and strides.
// One build serves every row size, both index types and both directions: the
// row size is a runtime argument, not a template parameter. The copy loops
// live in hicache_copy.cuh, shared with the resident kernel
// (hicache_resident.cu).

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>

#include "hicache_copy.cuh"
#include "hicache_transfer.h"

namespace {

template <typename Index, int kVec>
__global__ void __launch_bounds__(kPlainThreads) copy_rows_plain(const KernelParams p) {
  if (tables_stale(p.t)) return;
  plain_rows<Index, kVec>(p, blockIdx.x, gridDim.x);
}

template <typename Index>
__global__ void __launch_bounds__(kBulkLanes * kBulkMaxWarps, 1) copy_rows_bulk(const KernelParams p) {
  extern __shared__ __align__(128) unsigned char smem[];
  if (tables_stale(p.t)) return;
  bulk_rows<Index>(p, blockIdx.x, gridDim.x, blockDim.x / kBulkLanes, smem);
}

// Per-device facts the launcher needs, read once.
struct DeviceInfo {
  std::atomic<int> ready{0};
  int max_smem_optin = 0;
  bool bulk_capable = false;  // sm_90+ GPU and sm_90+ code for it in this binary
};
DeviceInfo g_devices[64];

template <typename Index>
bool prepare_bulk(int max_smem) {
  cudaFuncAttributes attr;
  if (cudaFuncGetAttributes(&attr, copy_rows_bulk<Index>) != cudaSuccess) return false;
  if (attr.binaryVersion < 90) return false;
  return cudaFuncSetAttribute(copy_rows_bulk<Index>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                              max_smem) == cudaSuccess;
}

int device_info(int device, DeviceInfo** out) {
  if (device < 0 || device >= 64) return -3;
  DeviceInfo& info = g_devices[device];
  if (info.ready.load(std::memory_order_acquire) == 0) {
    int major = 0;
    cudaError_t err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    if (err == cudaSuccess) {
      err = cudaDeviceGetAttribute(&info.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    }
    if (err != cudaSuccess) return err;
    info.bulk_capable = major >= 9 && prepare_bulk<int32_t>(info.max_smem_optin) &&
                        prepare_bulk<int64_t>(info.max_smem_optin);
    cudaGetLastError();  // a refused bulk kernel is not an error of the caller
    info.ready.store(1, std::memory_order_release);
  }
  *out = &info;
  return 0;
}

template <typename Index>
void launch_plain(const KernelParams& p, int vec, int blocks, cudaStream_t stream) {
  switch (vec) {
    case 16: copy_rows_plain<Index, 16><<<blocks, kPlainThreads, 0, stream>>>(p); break;
    case 8: copy_rows_plain<Index, 8><<<blocks, kPlainThreads, 0, stream>>>(p); break;
    default: copy_rows_plain<Index, 4><<<blocks, kPlainThreads, 0, stream>>>(p); break;
  }
}

template <typename Index>
int launch(const HicacheTransfer& t, const DeviceInfo& info, int method, cudaStream_t stream) {
  const int vec = method == HICACHE_METHOD_BULK ? 16 : vector_width(t);
  const BulkShape bulk = bulk_shape(t, info.max_smem_optin);
  KernelParams p = plan_params(t, method, bulk);
  const int64_t items_per_launch = kMaxWork / work_per_item(t, method);
  // Launches of at most 2^31 work items each keep every counter in 32 bits.
  for (int64_t start = 0; start < t.num_items; start += items_per_launch) {
    const int64_t n = t.num_items - start < items_per_launch ? t.num_items - start : items_per_launch;
    set_item_range<Index>(p, t, method, start, n);
    if (method == HICACHE_METHOD_BULK) {
      const int64_t chunks = (p.num_rows + kBulkLanes - 1) / kBulkLanes;
      const int64_t per_block = bulk.warps;
      const int64_t needed = (chunks + per_block - 1) / per_block;
      const int64_t quota = t.num_blocks > 0 ? t.num_blocks : kDefaultBulkBlocks;
      const int blocks = static_cast<int>(needed < quota ? needed : quota);
      copy_rows_bulk<Index><<<blocks, kBulkLanes * bulk.warps, bulk.smem, stream>>>(p);
    } else {
      const int64_t per_block = int64_t{kPlainThreads} * kPlainUnroll;
      const int64_t needed = (p.total_vecs + per_block - 1) / per_block;
      const int64_t quota = t.num_blocks > 0 ? t.num_blocks : kDefaultPlainBlocks;
      const int blocks = static_cast<int>(needed < quota ? needed : quota);
      launch_plain<Index>(p, vec, blocks, stream);
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return 0;
}

}  // namespace

extern "C" int hicache_transfer_launch(const HicacheTransfer* t, void* stream, int* method_used) {
  if (t == nullptr) return kErrInvalid;
  if (const int err = validate(*t)) return err;
  int device = 0;
  if (const cudaError_t err = cudaGetDevice(&device)) return err;
  DeviceInfo* info = nullptr;
  if (const int err = device_info(device, &info)) return err;
  const int method = resolve_method(*t, info->bulk_capable, info->max_smem_optin);
  if (method_used != nullptr) *method_used = method;
  if (t->num_items == 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  return t->index_bytes == 4 ? launch<int32_t>(*t, *info, method, s) : launch<int64_t>(*t, *info, method, s);
}

extern "C" const char* hicache_error_string(int code) {
  switch (code) {
    case 0: return "success";
    case kErrInvalid: return "invalid transfer arguments (row size, cache count, index size or pointers)";
    case kErrTooLarge: return "row too large for one transfer";
    case kErrDevice: return "no current CUDA device, or device ordinal above 63";
    case kErrNoStreamMemOps:
      return "the CUDA driver does not support 64-bit stream memory operations (needed by the resident method)";
    case kErrResidentStuck: return "the resident copy kernel did not answer within a second";
    default: return cudaGetErrorString(static_cast<cudaError_t>(code));
  }
}
