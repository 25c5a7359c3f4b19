// Aux-loss kernels: per-chunk partial sums (fixed chunks, fixed order: deterministic), their
// ordered reduction into the fp64 running sums, the scalar value and the per-row backward.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/moe_aux_loss/moe_aux_loss_cuda.h"

namespace deltamoe {

namespace {

constexpr int kRowsPerChunk = 64;
constexpr int64_t kMaxExperts = 8192;  // shared-memory counts / coefficients
constexpr int kWarpsPerBlock = 8;

size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }
int64_t num_chunks(int64_t rows) { return (rows + kRowsPerChunk - 1) / kRowsPerChunk; }

__global__ void partial_sums_kernel(const float* probs, const int32_t* topk_idx, int64_t rows, int num_experts,
                                    int top_k, double* partial_prob, int32_t* partial_count) {
  extern __shared__ int32_t counts[];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kRowsPerChunk;
  const int64_t r1 = min(rows, r0 + kRowsPerChunk);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int64_t i = r0 * top_k + threadIdx.x; i < r1 * top_k; i += blockDim.x) atomicAdd(&counts[topk_idx[i]], 1);
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    double sum = 0;
    for (int64_t r = r0; r < r1; ++r) sum += probs[r * num_experts + e];
    partial_prob[blockIdx.x * static_cast<int64_t>(num_experts) + e] = sum;
    partial_count[blockIdx.x * static_cast<int64_t>(num_experts) + e] = counts[e];
  }
}

__global__ void reduce_partials_kernel(const double* partial_prob, const int32_t* partial_count, int chunks,
                                       int num_experts, double* selected_count, double* prob_sum) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= num_experts) return;
  double sum = 0, count = 0;
  for (int c = 0; c < chunks; ++c) {
    sum += partial_prob[static_cast<int64_t>(c) * num_experts + e];
    count += partial_count[static_cast<int64_t>(c) * num_experts + e];
  }
  prob_sum[e] += sum;
  selected_count[e] += count;
}

__global__ void aux_value_kernel(const double* selected_count, const double* prob_sum, int num_experts,
                                 int64_t total_rows, double* aux) {
  if (threadIdx.x != 0) return;
  if (total_rows == 0) {
    *aux = 0.0;
    return;
  }
  const double rows = static_cast<double>(total_rows);
  double sum = 0;
  for (int e = 0; e < num_experts; ++e) sum += (selected_count[e] / rows) * (prob_sum[e] / rows);
  *aux = num_experts * sum;
}

// d p[e] = d_aux E count_e / R^2 for every row; then the softmax backward of each row (a warp).
__global__ void aux_backward_kernel(const float* probs, const double* selected_count, int64_t total_rows, float d_aux,
                                    float* d_logits, bool accumulate, int64_t rows, int num_experts) {
  extern __shared__ float coef[];
  const double r = static_cast<double>(total_rows);
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x)
    coef[e] = static_cast<float>(d_aux * (num_experts * (selected_count[e] / r) / r));
  __syncthreads();
  const int64_t row = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* p = probs + row * num_experts;
  float inner = 0;
  for (int e = lane; e < num_experts; e += 32) inner += p[e] * coef[e];
#pragma unroll
  for (int d = 16; d > 0; d /= 2) inner += __shfl_xor_sync(0xffffffffu, inner, d);
  float* out = d_logits + row * num_experts;
  for (int e = lane; e < num_experts; e += 32) out[e] = (accumulate ? out[e] : 0.0f) + p[e] * (coef[e] - inner);
}

void check_experts(const char* where, int64_t num_experts) {
  CHECK(num_experts >= 1 && num_experts <= kMaxExperts, where, ": expert count ", num_experts, " must be in [1, ",
        kMaxExperts, "]");
}

}  // namespace

void moe_aux_stats_reset_cuda(const MoeAuxDeviceStats& stats, int64_t num_experts, cudaStream_t stream) {
  check_experts("moe_aux_stats_reset_cuda", num_experts);
  CUDA_CHECK(cudaMemsetAsync(stats.selected_count, 0, num_experts * sizeof(double), stream));
  CUDA_CHECK(cudaMemsetAsync(stats.prob_sum, 0, num_experts * sizeof(double), stream));
}

size_t moe_aux_loss_accumulate_workspace_bytes(int64_t rows, int64_t num_experts) {
  const int64_t chunks = std::max<int64_t>(num_chunks(rows), 1);
  return align256(chunks * num_experts * sizeof(double)) + align256(chunks * num_experts * sizeof(int32_t));
}

void moe_aux_loss_accumulate_cuda(const float* probs, const int32_t* topk_idx, int64_t rows, int64_t num_experts,
                                  int64_t top_k, const MoeAuxDeviceStats& stats, void* workspace,
                                  size_t workspace_bytes, cudaStream_t stream) {
  check_experts("moe_aux_loss_accumulate_cuda", num_experts);
  CHECK(top_k >= 1 && top_k <= num_experts && rows >= 0, "moe_aux_loss_accumulate_cuda: top_k ", top_k, " rows ", rows);
  CHECK(workspace_bytes >= moe_aux_loss_accumulate_workspace_bytes(rows, num_experts),
        "moe_aux_loss_accumulate_cuda: workspace of ", workspace_bytes, " bytes, need ",
        moe_aux_loss_accumulate_workspace_bytes(rows, num_experts));
  if (rows == 0) return;
  const int64_t chunks = num_chunks(rows);
  double* partial_prob = static_cast<double*>(workspace);
  int32_t* partial_count =
      reinterpret_cast<int32_t*>(static_cast<char*>(workspace) + align256(chunks * num_experts * sizeof(double)));
  const int E = static_cast<int>(num_experts);
  partial_sums_kernel<<<static_cast<unsigned>(chunks), 256, E * sizeof(int32_t), stream>>>(
      probs, topk_idx, rows, E, static_cast<int>(top_k), partial_prob, partial_count);
  CUDA_CHECK_LAUNCH();
  reduce_partials_kernel<<<(E + 255) / 256, 256, 0, stream>>>(partial_prob, partial_count, static_cast<int>(chunks), E,
                                                              stats.selected_count, stats.prob_sum);
  CUDA_CHECK_LAUNCH();
}

void moe_aux_loss_value_cuda(const MoeAuxDeviceStats& stats, int64_t num_experts, int64_t total_rows, double* aux,
                             cudaStream_t stream) {
  check_experts("moe_aux_loss_value_cuda", num_experts);
  aux_value_kernel<<<1, 32, 0, stream>>>(stats.selected_count, stats.prob_sum, static_cast<int>(num_experts),
                                         total_rows, aux);
  CUDA_CHECK_LAUNCH();
}

void moe_aux_loss_backward_cuda(const float* probs, const MoeAuxDeviceStats& stats, int64_t total_rows, float d_aux,
                                float* d_logits, bool accumulate, int64_t rows, int64_t num_experts,
                                cudaStream_t stream) {
  check_experts("moe_aux_loss_backward_cuda", num_experts);
  CHECK(total_rows >= rows && rows >= 0, "moe_aux_loss_backward_cuda: layer rows ", rows,
        " exceed the pooled row count ", total_rows);
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  aux_backward_kernel<<<blocks, 32 * kWarpsPerBlock, num_experts * sizeof(float), stream>>>(
      probs, stats.selected_count, total_rows, d_aux, d_logits, accumulate, rows, static_cast<int>(num_experts));
  CUDA_CHECK_LAUNCH();
}

}  // namespace deltamoe
