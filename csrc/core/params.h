// Plain parameter structs handed from the binding layer to the kernels.
// No ATen here: kernels see raw pointers and sizes only.
#pragma once

#include <cstdint>

namespace msda {

enum class DType : int { f32 = 0, f16 = 1, bf16 = 2, f64 = 3 };

// Bytes of one element of `t`.
inline int64_t dtype_bytes(DType t) { return t == DType::f64 ? 8 : t == DType::f32 ? 4 : 2; }

// The largest power of two dividing ptr's address, at most 32 (the widest
// vector a kernel reads): the alignments the planners take.
inline int pointer_alignment(const void* ptr) {
  const auto a = reinterpret_cast<uintptr_t>(ptr);
  int align = 1;
  while (align < 32 && a % (2 * align) == 0) align *= 2;
  return align;
}

struct Problem {
  int64_t N = 0;   // batch
  int64_t S = 0;   // sum of H * W over levels
  int64_t M = 0;   // heads
  int64_t D = 0;   // channels per head
  int64_t Lq = 0;  // queries
  int L = 0;       // levels
  int P = 0;       // points per level
  DType value_dtype = DType::f32;
  DType loc_dtype = DType::f32;  // dtype of locations and weights (same for both)
  bool host_shapes = false;      // the caller passed the level shapes on the host too
  // value's layout: (N, S, M, D) contiguous, or head-major, the (N, S, M, D)
  // view of a contiguous (N, M, S, D) tensor (value_row() in sampling.h).
  // grad_value comes back in the same layout.
  bool value_head_major = false;
};

// Samples of a problem: one a (n, q, m, level, point).
inline int64_t sample_count(const Problem& pb) { return pb.N * pb.Lq * pb.M * pb.L * pb.P; }

// How the `blocked` forward sets up a row's samples (the bilinear corners and
// weights of each location): `shared`, once a sample by one lane, handed to
// the row's lanes through shared-memory slots; `lane`, by every lane of the
// row itself, with more corner loads in flight and no warp syncs (faster
// where warps are few: the decoders). `automatic`: the forward planner
// decides (lane_row_split(), plan/launch_shapes.h).
enum class BlockedRows : int { automatic, shared, lane };

// The forward backends with kernels of their own.
// pytorch: the Python entry points' backend, never a plan of the C++ operator.
enum class ForwardBackend : int { cpu, tma, cluster, persistent, blocked, baseline, pytorch };

// The forward's plan (plan/forward_plan.h decides it): the backend, and how
// its kernel is launched. Trivially copyable: it travels in ForwardParams.
struct ForwardPlan {
  ForwardBackend backend = ForwardBackend::baseline;
  bool composite = false;    // ms_deform_attn_fused: the ATen composite serves it
  bool copy_value = false;   // value's data is copied first (the backend's alignment)
  int vec = 1;               // elements a vector access (16 bytes, or 1)
  int lanes = 1;             // threads of a (query, head) row's group (lanes_for)
  int threads = 0;           // a block (baseline, blocked)
  int split = 0;             // blocked: groups a row with per-lane set-up; 0: slots
  bool one_level = false;    // blocked, slots, L == 1: no level table (no block barrier)
  int64_t blocks_per_head = 0;  // blocked: blocks a (batch, head)
  int64_t blocks = 0;        // the grid (baseline, blocked)
  int resident = 0;          // blocks an SM the shared-memory carve-out is sized for
  int64_t smem_budget = 0;   // persistent, cluster: cache bytes; tma: its two stages' bytes
  int64_t workspace = 0;     // bytes of zeroed scratch
};

struct ForwardParams {
  Problem pb;
  const void* value = nullptr;            // (N, S, M, D), pb.value_head_major: (N, M, S, D)
  const int64_t* spatial_shapes = nullptr; // (L, 2) on the kernel's device
  const int64_t* level_start = nullptr;    // (L,)
  const void* loc = nullptr;               // (N, Lq, M, L, P, 2)
  const void* attn = nullptr;              // (N, Lq, M, L, P)
  void* out = nullptr;                     // (N, Lq, M * D)
  ForwardPlan plan;                        // how the kernel is launched
  int vec = 1;                             // plan.vec (the dtype dispatch reads it from here)
  void* workspace = nullptr;               // zeroed scratch, plan.workspace bytes
  const int64_t* host_shapes = nullptr;    // (L, 2) (H, W) in host memory when pb.host_shapes
  // ms_deform_attn_fused (baseline, blocked): with ref set, loc holds the
  // sampling offsets, attn the attention logits, and ref the reference
  // points (N, Lq, L, ref_dim) in float32, ref_dim 2 (points) or 4 (boxes).
  const float* ref = nullptr;
  int ref_dim = 0;
};

// The backward's plan (plan/backward_plan.h decides it): how grad_value is
// formed, which kernel forms the corner dots, the vector widths, and whether
// the fused operator falls back to its ATen composite.
enum class GradValuePath : int {
  atomic,  // fp32 (fp64) atomics into a zeroed accumulator, then a conversion
  sorted,  // cell keys, a global radix sort, a gather per value pixel (bitwise reproducible)
  local,   // records grouped by cell inside a block per (n, m, level) (bitwise reproducible)
};
enum class DotsKernel : int {
  ffma,      // ffma_dots_kernel: FFMA, lanes over channels
  mma,       // mma_dots_kernel on tensor cores, whole (query, head) rows a warp task
  mma_flat,  // the same, all rows' sample slots one sequence (no idle lanes where L Pp does not divide 32)
  mma_rows,  // the fused operator's: a block task of whole rows (L Pp does not divide 32)
};
enum class GatherKernel : int { none, pixels, tiles };  // the global sort's gather
struct BackwardPlan {
  GradValuePath grad_value = GradValuePath::atomic;
  DotsKernel dots = DotsKernel::ffma;
  int vec = 1;                               // elements a vector access of the dots kernel
  GatherKernel gather = GatherKernel::none;
  int gather_vec = 1;                        // elements a vector access of the gather
  bool composite = false;                    // fused only: the ATen composite serves it
  // grad_value local: a block copies its (n, m)'s grad_output rows and its
  // tile's corner weights into shared memory before walking the pixels
  // (local_stage_bytes), so that the walk waits on no global load.
  bool stage = false;
  // grad_value local, staged, not fused: the block resolves its (n, m,
  // level)'s samples itself from the locations and weights, so that it does
  // not wait for the dots kernel's records and runs beside it (a forked
  // stream); the dots kernel writes none (local_cell null).
  bool self_records = false;
  constexpr bool deterministic() const { return grad_value != GradValuePath::atomic; }
};

struct BackwardParams {
  Problem pb;
  const void* value = nullptr;
  const int64_t* spatial_shapes = nullptr;
  const int64_t* level_start = nullptr;
  const void* loc = nullptr;
  const void* attn = nullptr;
  const void* grad_out = nullptr;  // (N, Lq, M * D), value dtype
  BackwardPlan plan;               // the path the kernels take
  int vec = 1;                     // plan.vec (the dtype dispatch reads it from here)
  // plan.grad_value atomic: value's shape and layout in the accumulation type, zeroed
  void* grad_value_acc = nullptr;
  void* grad_loc = nullptr;        // like loc
  void* grad_attn = nullptr;       // like attn
  // plan.grad_value sorted: the dots kernel also writes, for every sample
  // (flat index (n, q, m, l, p)), the key of the bilinear cell its footprint
  // lies in (cell_key() in cuda/device/grad_value_records.cuh) and the sample's index.
  void* cell_keys = nullptr;   // (samples,) uint32, or uint64 when wide_keys
  void* sample_ids = nullptr;  // (samples,) same type
  bool wide_keys = false;
  int64_t cell_stride = 0;     // keys per (n, m): 2 * S + 2 * L bounds the cells of all levels
  // plan.grad_value local (cuda/backward/local_grad_value.cu): the dots
  // kernel writes every sample's record for it instead (at ((n M + m) L + l)
  // Lq P + q P + p): the sample's cell on its level, (h0 + 1) (W + 1) + w0 + 1
  // (0xffffffff where it adds nothing), and its four corner weights times its
  // attention weight, fp32, in the order (0, 2, 1, 3).
  void* local_cell = nullptr;  // (samples,) uint32
  void* local_wts = nullptr;   // (samples, 4) float, 16-byte aligned
  // ms_deform_attn_fused: with ref set, loc holds the sampling offsets and
  // attn the attention logits, as in ForwardParams; grad_loc and grad_attn
  // receive the gradients of those; on a deterministic plan row_stats
  // (N, Lq, M) receives the (max, 1 / sum of exp) of each row's softmax,
  // which the dots kernel writes for the kernels after it.
  const float* ref = nullptr;
  int ref_dim = 0;
  float* row_stats = nullptr;  // 2 floats a row
};

}  // namespace msda
