// The C interface between the torch-free CUDA code (hicache_transfer.cu) and
// the thin torch binding (binding.cpp). Plain C types only, so the binding
// compiles without CUDA headers and the .cu file without torch headers.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// One gather/scatter copy of KV rows.
//
// A "row" is the bytes of one token in one layer of one cache. For item i
// (0 <= i < num_items), cache c (0 <= c < num_caches: 1 for MLA, 2 for K and
// V) and layer l (0 <= l < num_layers), the kernel copies row_bytes bytes from
//     src_base(c, l) + indices_src[i] * src_stride
// to
//     dst_base(c, l) + indices_dst[i] * dst_stride.
// A base comes from src_tables[c][l] when the table pointer is non-null (a
// device array of num_layers uint64 addresses), else from src_bases[c] (then
// num_layers must be 1). The same holds for the destination side.
//
// A negative index skips its item. An index >= src_rows (dst_rows) is never
// read (written): the item is skipped and a bit is set in *error_flags.
typedef struct HicacheTransfer {
  const uint64_t* src_tables[2];
  const uint64_t* dst_tables[2];
  uint64_t src_bases[2];
  uint64_t dst_bases[2];
  int32_t num_caches;
  int32_t num_layers;

  const void* indices_src;  // device memory
  const void* indices_dst;  // device memory
  int32_t index_bytes;      // 4 (int32) or 8 (int64)
  int64_t num_items;

  int64_t src_stride;  // bytes between consecutive slots
  int64_t dst_stride;
  int64_t row_bytes;   // a positive multiple of 4
  int64_t src_rows;    // slot count of the source pool, or -1 when unknown
  int64_t dst_rows;

  int32_t num_blocks;  // SM budget: CTAs to launch; 0 picks the measured default
  int32_t method;      // HICACHE_METHOD_*
  // Bulk-method tuning; 0 picks the measured default.
  int32_t bulk_warps;  // warps per CTA, each with its own pipeline (1..8)
  int32_t read_align;  // bulk loads read whole aligned spans of this many bytes
                       // (16..256, a power of two) when the pool bounds allow it
  // HICACHE_ERROR_WORDS device-visible words (pinned host memory) or NULL;
  // the kernel stores 1 into word HICACHE_ERR_* when that error occurs.
  uint32_t* error_flags;
  int32_t hints;  // HICACHE_HINT_* bits the caller knows (0: none)
  // The caller's own pointer tables (device arrays of num_layers addresses) whose checked copies are
  // src_tables/dst_tables, or NULL. Where any is set, every CTA first compares each with its copy; if
  // one differs (the caller rewrote it where its checker could not see), the CTA copies nothing and
  // word HICACHE_ERR_STALE_TABLE is set: no row moves through addresses nobody checked, nor through
  // ones the caller no longer means.
  const uint64_t* src_live[2];
  const uint64_t* dst_live[2];
} HicacheTransfer;

enum {
  HICACHE_METHOD_AUTO = 0,   // bulk copy where the GPU and the rows allow it
  HICACHE_METHOD_PLAIN = 1,  // vectorized loads and stores from SM threads
  HICACHE_METHOD_BULK = 2,   // Hopper bulk-copy engine (cp.async.bulk), sm_90+
};

// Facts about the transfer that only the caller knows; they tune the copy and
// never change what it copies.
enum {
  // The destination is GPU memory: the bulk method refills a shared-memory
  // stage as soon as its store has read it (a store into GPU memory reads the
  // stage quickly; one to host memory is left in flight instead).
  HICACHE_HINT_DST_DEVICE = 1,
};

// Words of error_flags, set by the kernel, read and cleared by Python. Plain
// stores, not atomics: system-scope atomics on host memory need PCIe AtomicOps.
enum {
  HICACHE_ERR_SRC_INDEX = 0,   // an index in indices_src was >= src_rows
  HICACHE_ERR_DST_INDEX = 1,   // an index in indices_dst was >= dst_rows
  HICACHE_ERR_MISALIGNED = 2,  // a row address was not 4-byte aligned
  HICACHE_ERR_STALE_TABLE = 3,  // a caller's pointer table no longer held the checked addresses
  HICACHE_ERROR_WORDS = 4,
};

// Launches the copy on `stream` (a cudaStream_t) of the current device and
// stores the method it chose (HICACHE_METHOD_PLAIN or _BULK) in *method_used
// (may be NULL). Returns 0 on success, else a cudaError_t value (see
// hicache_error_string) or a negative value for invalid arguments.
int hicache_transfer_launch(const HicacheTransfer* transfer, void* stream, int* method_used);

// A readable message for a value returned by hicache_transfer_launch.
const char* hicache_error_string(int code);


// ---- Resident copies (hicache_resident.cu) ----------------------------------
//
// A few CTAs stay resident on the GPU and take transfers from a queue, so a
// transfer needs no kernel launch and never waits for SMs that other work
// holds. Stream order is kept without SMs: hicache_resident_submit enqueues on
// `stream` a memory write that releases the transfer once the stream's earlier
// work is done, then a wait that holds the stream's later work until the
// resident CTAs report it finished. The kernel exits after idle_us without
// work (a device-wide synchronize waits at most that long for it) and is
// relaunched by the next submit.
typedef struct HicacheResident HicacheResident;

// Bits or'ed into *method_used by hicache_resident_submit.
enum { HICACHE_RESIDENT_QUEUED = 16 };  // went through the queue (else launched as usual)

// Creates the queue for the current device: `blocks` resident CTAs (1 to the
// SM count), `queue_slots` entries (1..256), exiting after `idle_us` idle.
// Returns 0 or an error (see hicache_error_string); -4: the driver lacks
// 64-bit stream memory operations.
int hicache_resident_create(int blocks, int queue_slots, int64_t idle_us, HicacheResident** out);

// Like hicache_transfer_launch, through the queue. Falls back to an ordinary
// launch on `stream` (same order guarantees) while the stream is being
// captured into a CUDA graph, when the queue is full, for a transfer too
// large for one queue entry, and for rows or strides that are not multiples
// of 16 bytes.
int hicache_resident_submit(HicacheResident* r, const HicacheTransfer* transfer, void* stream, int* method_used);

// Counters since creation: [0] kernel launches, [1] transfers queued,
// [2] fallbacks to an ordinary launch, [3] transfers finished.
void hicache_resident_stats(const HicacheResident* r, uint64_t out[4]);

// Waits (at most timeout_ms) for queued transfers whose streams have reached
// them, stops the kernel, waits for it to exit and frees the queue.
int hicache_resident_destroy(HicacheResident* r, int64_t timeout_ms);

#ifdef __cplusplus
}
#endif
