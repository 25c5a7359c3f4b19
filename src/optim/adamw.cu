// CUDA AdamW, written with explicitly rounded intrinsics so the compiler cannot contract a*b+c into
// FMA and the result equals the CPU reference bitwise. Memory-bound (22 bytes a parameter with bf16
// moments, 30 with fp32 ones): each thread updates four consecutive elements per iteration through
// 16-byte (fp32) and 8-byte (bf16) accesses, and the gradient's division by the token count is the
// exact fp32 form where one exists (gradient_divide.h), not fp64 division per element. A split
// master (split_master.h) takes 20 bytes: its two halves read and written, no separate copy; 18
// with a bf16 gradient (the routed experts').
#include <algorithm>
#include <cstdint>
#include <limits>

#include "core/cuda_check.h"
#include "optim/adamw_cuda.h"
#include "optim/split_master.h"
#include "kernels/common/gradient_divide.h"

namespace deltamoe {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = AdamWLaunchPlan::kGridBlocks;
constexpr int kVector = 4;  // elements a thread updates per iteration

// torch's lerp, fused as the CPU reference writes it (bitwise equal to torch's CPU AdamW).
__device__ __forceinline__ float torch_lerp(float start, float end, float weight) {
  const float diff = __fsub_rn(end, start);
  return fabsf(weight) < 0.5f ? __fmaf_rn(weight, diff, start) : __fmaf_rn(-diff, __fsub_rn(1.0f, weight), end);
}

// GradientScaling as the kernels read it.
struct DeviceScaling {
  GradientDivisor divisor;
  float clip_coef;
  bool clip;
};

template <GradientDivide kDivide>
__device__ __forceinline__ void adamw_element(const AdamWStepScalars& s, float decay_factor, const DeviceScaling& scaling,
                                              float& p, float g, float& m, float& v) {
  g = divide_gradient<kDivide>(g, scaling.divisor);
  if (scaling.clip) g = __fmul_rn(g, scaling.clip_coef);
  p = __fmul_rn(p, decay_factor);
  m = torch_lerp(m, g, s.one_minus_beta1);
  v = __fmaf_rn(__fmul_rn(s.one_minus_beta2, g), g, __fmul_rn(v, s.beta2));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), s.bias_correction2_sqrt), s.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

__device__ __forceinline__ float load_moment(const float* ptr) { return *ptr; }
__device__ __forceinline__ float load_moment(const __nv_bfloat16* ptr) { return __bfloat162float(*ptr); }
__device__ __forceinline__ void store_moment(float* ptr, float value) { *ptr = value; }
__device__ __forceinline__ void store_moment(__nv_bfloat16* ptr, float value) { *ptr = __float2bfloat16_rn(value); }

// Four consecutive moments (16 bytes of fp32 or 8 of bf16, aligned to their size).
__device__ __forceinline__ void load_moments(const float* ptr, float (&out)[kVector]) {
  const float4 x = *reinterpret_cast<const float4*>(ptr);
  out[0] = x.x, out[1] = x.y, out[2] = x.z, out[3] = x.w;
}
__device__ __forceinline__ void load_moments(const __nv_bfloat16* ptr, float (&out)[kVector]) {
  const uint2 bits = *reinterpret_cast<const uint2*>(ptr);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits.y));
  out[0] = lo.x, out[1] = lo.y, out[2] = hi.x, out[3] = hi.y;
}
// Four consecutive gradients, widened (16 bytes of fp32 or 8 of bf16, aligned to their size).
__device__ __forceinline__ void load_grads(const float* ptr, float (&out)[kVector]) { load_moments(ptr, out); }
__device__ __forceinline__ void load_grads(const __nv_bfloat16* ptr, float (&out)[kVector]) {
  load_moments(ptr, out);
}
__device__ __forceinline__ float load_grad(const float* ptr) { return *ptr; }
__device__ __forceinline__ float load_grad(const __nv_bfloat16* ptr) { return __bfloat162float(*ptr); }
__device__ __forceinline__ uint2 pack_bf16(const float (&x)[kVector]) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(x[0], x[1]), hi = __floats2bfloat162_rn(x[2], x[3]);
  return make_uint2(*reinterpret_cast<const uint32_t*>(&lo), *reinterpret_cast<const uint32_t*>(&hi));
}
// Four masters' halves (split_master.h), packed: the bf16 working weights (high) or the low halves.
template <bool kHigh>
__device__ __forceinline__ uint2 pack_halves(const float (&x)[kVector]) {
  uint32_t halves[2] = {0, 0};
#pragma unroll
  for (int u = 0; u < kVector; ++u) {
    const uint32_t bits = __float_as_uint(x[u]);
    const uint16_t half = kHigh ? split_master_high(bits) : split_master_low(bits);
    halves[u / 2] |= static_cast<uint32_t>(half) << (16 * (u % 2));
  }
  return make_uint2(halves[0], halves[1]);
}
__device__ __forceinline__ void store_moments(float* ptr, const float (&x)[kVector]) {
  *reinterpret_cast<float4*>(ptr) = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void store_moments(__nv_bfloat16* ptr, const float (&x)[kVector]) {
  *reinterpret_cast<uint2*>(ptr) = pack_bf16(x);
}

// A span's master as the kernel sees it (MasterSpan on the device): kSplit false reads and writes
// f32 (and writes weights, when set, with the master's high half: bf16, ties away from zero, the
// same weight a split master holds); kSplit true joins and splits the two halves.
struct DeviceMaster {
  float* f32;
  __nv_bfloat16* weights;
  uint16_t* low;
  bool weights_vector;  // f32 form: the bf16 copy stored 8 bytes at a time (else one by one)
};

template <bool kSplit>
__device__ __forceinline__ float load_master(const DeviceMaster& master, int64_t i) {
  if constexpr (kSplit) {
    return __uint_as_float(join_split_master(__bfloat16_as_ushort(master.weights[i]), master.low[i]));
  } else {
    return master.f32[i];
  }
}

template <bool kSplit>
__device__ __forceinline__ void store_master(const DeviceMaster& master, int64_t i, float p) {
  if constexpr (kSplit) {
    const uint32_t bits = __float_as_uint(p);
    master.weights[i] = __ushort_as_bfloat16(split_master_high(bits));
    master.low[i] = split_master_low(bits);
  } else {
    master.f32[i] = p;
    if (master.weights != nullptr) master.weights[i] = __ushort_as_bfloat16(split_master_high(__float_as_uint(p)));
  }
}

// Four consecutive masters at e (aligned for the vectors there).
template <bool kSplit>
__device__ __forceinline__ void load_masters(const DeviceMaster& master, int64_t e, float (&p)[kVector]) {
  if constexpr (kSplit) {
    const uint2 high = *reinterpret_cast<const uint2*>(master.weights + e);
    const uint2 low = *reinterpret_cast<const uint2*>(master.low + e);
    const uint32_t highs[2] = {high.x, high.y}, lows[2] = {low.x, low.y};
#pragma unroll
    for (int u = 0; u < kVector; ++u) {
      const int shift = 16 * (u % 2);
      p[u] = __uint_as_float(join_split_master(static_cast<uint16_t>(highs[u / 2] >> shift),
                                               static_cast<uint16_t>(lows[u / 2] >> shift)));
    }
  } else {
    const float4 p4 = *reinterpret_cast<const float4*>(master.f32 + e);
    p[0] = p4.x, p[1] = p4.y, p[2] = p4.z, p[3] = p4.w;
  }
}

template <bool kSplit>
__device__ __forceinline__ void store_masters(const DeviceMaster& master, int64_t e, const float (&p)[kVector]) {
  if constexpr (kSplit) {
    *reinterpret_cast<uint2*>(master.weights + e) = pack_halves<true>(p);
    *reinterpret_cast<uint2*>(master.low + e) = pack_halves<false>(p);
  } else {
    *reinterpret_cast<float4*>(master.f32 + e) = make_float4(p[0], p[1], p[2], p[3]);
    if (master.weights == nullptr) return;
    if (master.weights_vector) {
      *reinterpret_cast<uint2*>(master.weights + e) = pack_halves<true>(p);
    } else {
#pragma unroll
      for (int u = 0; u < kVector; ++u)
        master.weights[e + u] = __ushort_as_bfloat16(split_master_high(__float_as_uint(p[u])));
    }
  }
}

template <typename Moment, typename Grad, GradientDivide kDivide, bool kSplit>
__device__ __forceinline__ void update_one(const AdamWStepScalars& s, float decay_factor, const DeviceScaling& scaling,
                                           int64_t i, const DeviceMaster& master, const Grad* grad, Moment* m,
                                           Moment* v) {
  float p = load_master<kSplit>(master, i), m_value = load_moment(m + i), v_value = load_moment(v + i);
  adamw_element<kDivide>(s, decay_factor, scaling, p, load_grad(grad + i), m_value, v_value);
  store_master<kSplit>(master, i, p);
  store_moment(m + i, m_value);
  store_moment(v + i, v_value);
}

// One span's launch as the kernel reads it: elements [head, head + 4 n4) four at a time (master,
// gradient and moments aligned there for their vector widths; an fp32 master's bf16 copy too when
// weights_vector, else stored one by one: a ZeRO-2 piece's weight copy starts wherever its bucket
// puts it), [0, head) and [head + 4 n4, count) one at a time, by `blocks` blocks striding over it.
// Each element's arithmetic is the same either way.
struct SpanTask {
  int64_t count, head, n4;
  DeviceMaster master;
  const void* grad;
  void* m;
  void* v;
  int32_t blocks;      // the span's share of the grid
  int32_t scalar_set;  // which of the launch's step scalars (one per learning-rate multiplier)
  int32_t decay;       // 1: the decay factor, 0: none
};

constexpr int kMaxScalarSets = 8;
struct ScalarSets {
  AdamWStepScalars set[kMaxScalarSets];
};

// `single` alone (kTable false: its fields are kernel parameters, uniform to the compiler, as a
// large piece's launch had them before the table existed), or the span of `tasks` whose blocks
// hold this block: first_block ascends from 0, so the last entry at or below blockIdx.x. One launch
// then updates every small piece of a layout (a layer has ~16 dense ones) instead of one each.
template <typename Moment, typename Grad, GradientDivide kDivide, bool kSplit, bool kTable>
__global__ void adamw_kernel(const __grid_constant__ ScalarSets sets, DeviceScaling scaling,
                             const __grid_constant__ SpanTask single, const SpanTask* tasks,
                             const int32_t* first_block, int num_tasks) {
  int64_t block = blockIdx.x;
  const SpanTask* task = &single;
  if constexpr (kTable) {
    int lo = 0, hi = num_tasks - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (first_block[mid] <= blockIdx.x) lo = mid; else hi = mid - 1;
    }
    task = tasks + lo;
    block -= first_block[lo];
  }
  const int64_t count = task->count, head = task->head, n4 = task->n4;
  const DeviceMaster master = task->master;
  const Grad* grad = static_cast<const Grad*>(task->grad);
  Moment* m = static_cast<Moment*>(task->m);
  Moment* v = static_cast<Moment*>(task->v);
  // In registers, not read from the parameter space inside the loops.
  const AdamWStepScalars scalars = sets.set[task->scalar_set];
  const float decay_factor = task->decay ? scalars.decay_factor : scalars.decay_factor_no_decay;
  const int64_t tid = block * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(task->blocks) * kThreads;
  for (int64_t i = tid; i < n4; i += stride) {
    const int64_t e = head + kVector * i;
    float p[kVector], g[kVector], m_values[kVector], v_values[kVector];
    load_grads(grad + e, g);
    load_masters<kSplit>(master, e, p);
    load_moments(m + e, m_values);
    load_moments(v + e, v_values);
#pragma unroll
    for (int u = 0; u < kVector; ++u)
      adamw_element<kDivide>(scalars, decay_factor, scaling, p[u], g[u], m_values[u], v_values[u]);
    store_masters<kSplit>(master, e, p);
    store_moments(m + e, m_values);
    store_moments(v + e, v_values);
  }
  for (int64_t i = tid; i < head; i += stride)
    update_one<Moment, Grad, kDivide, kSplit>(scalars, decay_factor, scaling, i, master, grad, m, v);
  for (int64_t i = head + kVector * n4 + tid; i < count; i += stride)
    update_one<Moment, Grad, kDivide, kSplit>(scalars, decay_factor, scaling, i, master, grad, m, v);
}

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// The task of a span (without its scalar set): where its vectors start, how many blocks it takes.
template <typename Moment, typename Grad>
SpanTask span_task(int64_t count, const MasterSpan& span, const Grad* grad, Moment* m, Moment* v, bool decay) {
  // The vectors start where the master (its low halves when split) is aligned for four elements;
  // the gradient, the moments and a split master's high halves must be aligned for their widths at
  // the same element (true for the flat layouts' pieces, kFlatAlignmentElements), else every
  // element goes one at a time. An fp32 master's bf16 copy is stored 8 bytes at a time where it is
  // aligned too, else one by one.
  const bool split = span.low != nullptr;
  const auto misalignment =
      split ? static_cast<int64_t>((reinterpret_cast<uintptr_t>(span.low) % 8) / sizeof(uint16_t))
            : static_cast<int64_t>((reinterpret_cast<uintptr_t>(span.f32) % 16) / sizeof(float));
  int64_t head = std::min<int64_t>(count, (kVector - misalignment) % kVector);
  const bool vectors = (split ? aligned(span.low, sizeof(uint16_t)) && aligned(span.weights_bf16 + head, 8)
                              : aligned(span.f32, sizeof(float))) &&
                       aligned(grad + head, kVector * sizeof(Grad)) && aligned(m + head, kVector * sizeof(Moment)) &&
                       aligned(v + head, kVector * sizeof(Moment));
  if (!vectors) head = count;
  const DeviceMaster master{span.f32, span.weights_bf16, span.low,
                            span.weights_bf16 == nullptr || aligned(span.weights_bf16 + head, 8)};
  const int64_t n4 = (count - head) / kVector;
  const int64_t work = std::max<int64_t>(n4, std::max<int64_t>(head, count - head - kVector * n4));
  const auto blocks = static_cast<int32_t>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
  return SpanTask{count, head, n4, master, grad, m, v, blocks, 0, decay ? 1 : 0};
}

void check_span(int64_t count, const MasterSpan& master, const GradientSpan& grad, const void* m, const void* v) {
  CHECK(count >= 0, "adamw: negative count ", count);
  CHECK((master.f32 != nullptr) != (master.low != nullptr),
        "adamw: a master is either fp32 or split, so exactly one of its fp32 values and its low "
        "halves is given");
  CHECK(master.low == nullptr || master.weights_bf16 != nullptr,
        "adamw: a split master needs its high halves (the bf16 weights)");
  CHECK(grad.data != nullptr && m != nullptr && v != nullptr,
        "adamw: null gradient or moment buffer");
  CHECK(grad.dtype == DType::f32 || grad.dtype == DType::bf16,
        "adamw: gradients must be f32 or bf16, not ", dtype_name(grad.dtype));
}

SpanTask make_task(DType moment_dtype, int64_t count, const MasterSpan& master, const GradientSpan& grad, void* m,
                   void* v, bool decay) {
  const bool bf16_grad = grad.dtype == DType::bf16;
  if (moment_dtype == DType::f32) {
    return bf16_grad ? span_task(count, master, static_cast<const __nv_bfloat16*>(grad.data), static_cast<float*>(m),
                                 static_cast<float*>(v), decay)
                     : span_task(count, master, static_cast<const float*>(grad.data), static_cast<float*>(m),
                                 static_cast<float*>(v), decay);
  }
  return bf16_grad ? span_task(count, master, static_cast<const __nv_bfloat16*>(grad.data),
                               static_cast<__nv_bfloat16*>(m), static_cast<__nv_bfloat16*>(v), decay)
                   : span_task(count, master, static_cast<const float*>(grad.data), static_cast<__nv_bfloat16*>(m),
                               static_cast<__nv_bfloat16*>(v), decay);
}

// The spans' kind: how the kernel reads their gradient and master (one instantiation each).
struct SpanKind {
  bool bf16_grad = false;
  bool split = false;
  bool operator==(const SpanKind&) const = default;
};

template <typename Moment, typename Grad, bool kSplit, bool kTable>
void launch_for_divisor(const ScalarSets& sets, const DeviceScaling& scaling, const SpanTask& single,
                        const SpanTask* tasks, const int32_t* first_block, int num_tasks, int64_t blocks,
                        cudaStream_t stream) {
  const auto grid = static_cast<unsigned>(blocks);
  switch (scaling.divisor.kind) {
    case GradientDivide::none:
      adamw_kernel<Moment, Grad, GradientDivide::none, kSplit, kTable><<<grid, kThreads, 0, stream>>>(
          sets, scaling, single, tasks, first_block, num_tasks);
      break;
    case GradientDivide::f32:
      adamw_kernel<Moment, Grad, GradientDivide::f32, kSplit, kTable><<<grid, kThreads, 0, stream>>>(
          sets, scaling, single, tasks, first_block, num_tasks);
      break;
    case GradientDivide::f64:
      adamw_kernel<Moment, Grad, GradientDivide::f64, kSplit, kTable><<<grid, kThreads, 0, stream>>>(
          sets, scaling, single, tasks, first_block, num_tasks);
      break;
  }
  CUDA_CHECK_LAUNCH();
}

template <typename Moment, typename Grad, bool kSplit>
void launch_for_table(const ScalarSets& sets, const DeviceScaling& scaling, const SpanTask& single,
                      const SpanTask* tasks, const int32_t* first_block, int num_tasks, int64_t blocks,
                      cudaStream_t stream) {
  if (tasks == nullptr)
    launch_for_divisor<Moment, Grad, kSplit, false>(sets, scaling, single, tasks, first_block, num_tasks, blocks, stream);
  else
    launch_for_divisor<Moment, Grad, kSplit, true>(sets, scaling, single, tasks, first_block, num_tasks, blocks, stream);
}

// One launch: `single` (tasks null) or the table's num_tasks tasks over `blocks` blocks in all.
template <typename Moment>
void launch_kind(SpanKind kind, const ScalarSets& sets, const DeviceScaling& scaling, const SpanTask& single,
                 const SpanTask* tasks, const int32_t* first_block, int num_tasks, int64_t blocks,
                 cudaStream_t stream) {
  if (kind.bf16_grad) {
    if (kind.split)
      launch_for_table<Moment, __nv_bfloat16, true>(sets, scaling, single, tasks, first_block, num_tasks, blocks, stream);
    else
      launch_for_table<Moment, __nv_bfloat16, false>(sets, scaling, single, tasks, first_block, num_tasks, blocks, stream);
  } else {
    if (kind.split)
      launch_for_table<Moment, float, true>(sets, scaling, single, tasks, first_block, num_tasks, blocks, stream);
    else
      launch_for_table<Moment, float, false>(sets, scaling, single, tasks, first_block, num_tasks, blocks, stream);
  }
}

void launch(DType moment_dtype, SpanKind kind, const ScalarSets& sets, const GradientScaling& scaling,
            const SpanTask& single, const SpanTask* tasks, const int32_t* first_block, int num_tasks, int64_t blocks,
            cudaStream_t stream) {
  const DeviceScaling device_scaling{gradient_divisor(scaling.divisor), scaling.clip_coef, scaling.clip_coef < 1.0f};
  if (moment_dtype == DType::f32)
    launch_kind<float>(kind, sets, device_scaling, single, tasks, first_block, num_tasks, blocks, stream);
  else
    launch_kind<__nv_bfloat16>(kind, sets, device_scaling, single, tasks, first_block, num_tasks, blocks, stream);
}

void check_scaling(const GradientScaling& scaling) {
  CHECK(scaling.divisor > 0 && scaling.clip_coef > 0, "adamw: gradient divisor ", scaling.divisor,
        " and clip factor ", scaling.clip_coef, " must be positive");
}

}  // namespace

void adamw_update_span_cuda(const AdamWStepScalars& scalars, bool decay, DType moment_dtype, int64_t count,
                            const MasterSpan& master, const GradientSpan& grad, const GradientScaling& scaling,
                            void* m, void* v, cudaStream_t stream) {
  check_scaling(scaling);
  CHECK(moment_dtype == DType::f32 || moment_dtype == DType::bf16,
        "adamw_update_span_cuda: moments must be f32 or bf16, not ", dtype_name(moment_dtype));
  CHECK(count >= 0, "adamw_update_span_cuda: negative count ", count);
  if (count == 0) return;
  check_span(count, master, grad, m, v);
  ScalarSets sets{};
  sets.set[0] = scalars;
  const SpanTask task = make_task(moment_dtype, count, master, grad, m, v, decay);
  launch(moment_dtype, SpanKind{grad.dtype == DType::bf16, master.low != nullptr}, sets, scaling, task, nullptr,
         nullptr, 0, task.blocks, stream);
}

// A launch of the plan: one task alone, or a range of the device table.
struct AdamWLaunchPlan::Launch {
  SpanKind kind;
  SpanTask single{};
  int first_task = 0;  // in the table (num_tasks > 0)
  int num_tasks = 0;
  int64_t blocks = 0;
};

AdamWLaunchPlan::AdamWLaunchPlan(const ParamLayout& layout, DType moment_dtype, const std::vector<MasterSpan>& masters,
                                 const std::vector<GradientSpan>& grads, void* m, void* v, int32_t own_launch_blocks)
    : moment_dtype_(moment_dtype) {
  CHECK(moment_dtype == DType::f32 || moment_dtype == DType::bf16,
        "adamw plan: moments must be f32 or bf16, not ", dtype_name(moment_dtype));
  CHECK(static_cast<int>(masters.size()) == layout.num_tensors() &&
            static_cast<int>(grads.size()) == layout.num_tensors(),
        "adamw plan: ", masters.size(), " masters and ", grads.size(), " gradients for ", layout.num_tensors(),
        " pieces");
  CHECK(own_launch_blocks >= 1, "adamw plan: own_launch_blocks must be positive, got ", own_launch_blocks);
  const size_t element_size = dtype_size(moment_dtype);
  // Pieces that fill the grid on their own (the experts' stacks, the embedding) keep a launch each,
  // as one piece alone runs; the rest are grouped by kind into one launch per kind.
  std::vector<std::pair<SpanKind, std::vector<SpanTask>>> grouped;
  for (int i = 0; i < layout.num_tensors(); ++i) {
    const ParamEntry& entry = layout.entry(i);
    if (entry.numel == 0) continue;
    const MasterSpan& master = masters[static_cast<size_t>(i)];
    const GradientSpan& grad = grads[static_cast<size_t>(i)];
    check_span(entry.numel, master, grad, m, v);
    const size_t moment_offset = static_cast<size_t>(entry.offset) * element_size;
    SpanTask task = make_task(moment_dtype, entry.numel, master, grad, static_cast<uint8_t*>(m) + moment_offset,
                              static_cast<uint8_t*>(v) + moment_offset, entry.decay);
    auto scale = std::find(lr_scales_.begin(), lr_scales_.end(), entry.lr_scale);
    if (scale == lr_scales_.end()) {
      CHECK(lr_scales_.size() < static_cast<size_t>(kMaxScalarSets), "adamw plan: more than ", kMaxScalarSets,
            " different learning-rate multipliers");
      scale = lr_scales_.insert(lr_scales_.end(), entry.lr_scale);
    }
    task.scalar_set = static_cast<int32_t>(scale - lr_scales_.begin());
    const SpanKind kind{grad.dtype == DType::bf16, master.low != nullptr};
    if (task.blocks >= own_launch_blocks) {
      launches_.push_back(Launch{kind, task, 0, 0, task.blocks});
      continue;
    }
    auto group = std::find_if(grouped.begin(), grouped.end(), [&](const auto& g) { return g.first == kind; });
    if (group == grouped.end()) group = grouped.insert(grouped.end(), {kind, {}});
    group->second.push_back(task);
  }
  std::vector<SpanTask> table;
  std::vector<int32_t> first_blocks;
  for (const auto& [kind, tasks] : grouped) {
    Launch group_launch{kind, SpanTask{}, static_cast<int>(table.size()), static_cast<int>(tasks.size()), 0};
    for (const SpanTask& task : tasks) {
      CHECK(group_launch.blocks + task.blocks <= std::numeric_limits<int32_t>::max(),
            "adamw plan: a group's grid passes 2^31 blocks");
      first_blocks.push_back(static_cast<int32_t>(group_launch.blocks));
      group_launch.blocks += task.blocks;
      table.push_back(task);
    }
    launches_.push_back(group_launch);
  }
  if (!table.empty()) {
    const size_t task_bytes = table.size() * sizeof(SpanTask);
    table_ = DeviceBuffer(task_bytes + first_blocks.size() * sizeof(int32_t));
    CUDA_CHECK(cudaMemcpy(table_.data(), table.data(), task_bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(table_.as<char>() + task_bytes, first_blocks.data(), first_blocks.size() * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    first_blocks_offset_ = task_bytes;
  }
}

AdamWLaunchPlan::~AdamWLaunchPlan() = default;
int AdamWLaunchPlan::num_launches() const { return static_cast<int>(launches_.size()); }
AdamWLaunchPlan::AdamWLaunchPlan(AdamWLaunchPlan&&) noexcept = default;
AdamWLaunchPlan& AdamWLaunchPlan::operator=(AdamWLaunchPlan&&) noexcept = default;

void AdamWLaunchPlan::step(const AdamWConfig& config, double lr, int64_t adam_step, const GradientScaling& scaling,
                           cudaStream_t stream) const {
  validate_adamw_config(config);
  CHECK(config.moment_dtype == moment_dtype_, "adamw plan: built for ", dtype_name(moment_dtype_),
        " moments, stepped with ", dtype_name(config.moment_dtype));
  check_scaling(scaling);
  ScalarSets sets{};
  for (size_t s = 0; s < lr_scales_.size(); ++s)
    sets.set[s] = adamw_step_scalars(config, lr_scales_[s] == 1.0 ? lr : lr * lr_scales_[s], adam_step);
  const auto* tasks = table_.as<const SpanTask>();
  const auto* first_blocks = reinterpret_cast<const int32_t*>(table_.as<const char>() + first_blocks_offset_);
  for (const Launch& l : launches_) {
    if (l.num_tasks == 0)
      launch(moment_dtype_, l.kind, sets, scaling, l.single, nullptr, nullptr, 0, l.blocks, stream);
    else
      launch(moment_dtype_, l.kind, sets, scaling, SpanTask{}, tasks + l.first_task, first_blocks + l.first_task,
             l.num_tasks, l.blocks, stream);
  }
}

void adamw_step_cuda(const ParamLayout& layout, const AdamWConfig& config, double lr, int64_t adam_step,
                     const GradientScaling& scaling, const std::vector<MasterSpan>& masters,
                     const std::vector<GradientSpan>& grads, void* m, void* v, cudaStream_t stream) {
  validate_adamw_config(config);
  AdamWLaunchPlan(layout, config.moment_dtype, masters, grads, m, v).step(config, lr, adam_step, scaling, stream);
  // The plan's table is freed on return; the launches read it, so they finish first.
  CUDA_CHECK(cudaStreamSynchronize(stream));
}

std::vector<GradientSpan> flat_gradient_spans(const ParamLayout& layout, const float* grad) {
  std::vector<GradientSpan> spans;
  for (int i = 0; i < layout.num_tensors(); ++i) spans.push_back({grad + layout.entry(i).offset, DType::f32});
  return spans;
}

std::vector<MasterSpan> flat_master_spans(const ParamLayout& layout, float* master,
                                          const std::vector<__nv_bfloat16*>& weights_bf16) {
  CHECK(static_cast<int>(weights_bf16.size()) == layout.num_tensors(), "flat_master_spans: ", weights_bf16.size(),
        " bf16 destinations for ", layout.num_tensors(), " pieces");
  std::vector<MasterSpan> spans;
  for (int i = 0; i < layout.num_tensors(); ++i)
    spans.push_back({master + layout.entry(i).offset, weights_bf16[static_cast<size_t>(i)], nullptr});
  return spans;
}

}  // namespace deltamoe
