// The timed and the back-to-back steps of `deltamoe bench` (bench_steps.h).
#include "cli/gpu/bench_steps.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>

#include "core/cuda_check.h"
#include "core/error.h"
#include "kernels/cudnn_sdpa/gpu/cudnn_sdpa.h"
#include "kernels/gemm/gemm_cuda.h"

namespace deltamoe {

namespace {

double elapsed_ms(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

size_t free_device_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return free_bytes;
}

}  // namespace

ResourceSnapshot ResourceSnapshot::take() {
  ResourceSnapshot snapshot;
  snapshot.allocations = allocation_counts();
  snapshot.cudnn_plans = CudnnSdpa::plans_built();
  snapshot.cublaslt_queries = GemmContext::heuristic_queries();
  snapshot.free_bytes = free_device_bytes();
  return snapshot;
}

PackingShape packing_shape(const std::vector<MicroBatch>& batches) {
  PackingShape shape;
  for (const MicroBatch& batch : batches) {
    shape.samples += batch.num_samples();
    for (size_t i = 0; i + 1 < batch.cu_seqlens.size(); ++i)
      shape.longest = std::max<int64_t>(shape.longest, batch.cu_seqlens[i + 1] - batch.cu_seqlens[i]);
  }
  return shape;
}

TimedSteps run_timed_steps(GpuEngine& engine, const BenchSchedule& schedule, int rank) {
  TimedSteps timed;
  // A step's line names what it took that the step before it had not (after the first): where a
  // library loads or allocates on a new size.
  int64_t queries_before = 0;
  size_t free_before = 0;
  for (int64_t step = 0; step < schedule.warmup + schedule.steps; ++step) {
    const bool measured = step >= schedule.warmup;
    if (step == schedule.warmup) engine.text_model().timer().reset_totals();
    CUDA_CHECK(cudaDeviceSynchronize());
    const auto start = std::chrono::steady_clock::now();
    const std::vector<MicroBatch>& batches = schedule.step(step);
    timed.last = engine.train_step(batches, 1e-5, 1.0);
    engine.text_model().timer().finish(engine.text_model().stream());
    CUDA_CHECK(cudaDeviceSynchronize());
    const double ms = elapsed_ms(start);
    const StepResult& result = timed.last;
    const double loss = result.num_supervised > 0 ? result.ce_sum / static_cast<double>(result.num_supervised) : 0.0;
    if (step == 0) timed.first_loss = loss;
    timed.last_loss = loss;
    CHECK(std::isfinite(loss) && !result.skipped, "bench: the loss or the gradient norm is not finite at step ",
          step + 1, " (loss ", loss, ", norm ", result.grad_norm, ")");
    if (rank == 0) {
      std::string taken;
      const size_t free_bytes = free_device_bytes();
      const int64_t queries = GemmContext::heuristic_queries();
      if (step > 0 && (queries != queries_before || free_bytes != free_before)) {
        taken = str_cat("  (+", queries - queries_before, " cuBLASLt heuristic queries, GPU memory in use ",
                        static_cast<int64_t>(free_before) - static_cast<int64_t>(free_bytes), " bytes)");
      }
      queries_before = queries;
      free_before = free_bytes;
      const PackingShape shape = packing_shape(batches);
      std::printf("step %3lld %s %8.2f ms  loss %.4f  grad_norm %.3f  tokens %lld in %lld samples (longest %lld)%s\n",
                  static_cast<long long>(step + 1), measured ? "    " : "warm", ms, loss, result.grad_norm,
                  static_cast<long long>(result.num_tokens), static_cast<long long>(shape.samples),
                  static_cast<long long>(shape.longest), taken.c_str());
      std::fflush(stdout);
    }
    if (measured) {
      timed.step_ms.push_back(ms);
      timed.measured_ms += ms;
      timed.measured_flops += result.flops;
      for (const MicroBatch& batch : batches) timed.measured_tokens += static_cast<double>(batch.num_tokens());
    }
    if (step == 0) timed.after_first = ResourceSnapshot::take();
  }
  return timed;
}

BackToBackSteps run_back_to_back(GpuEngine& engine, const BenchSchedule& schedule, int rank) {
  // The host prepares each batch (token checks, rope tables, the embedding's gradient plan: ~3 ms at
  // 8,192 tokens) while the GPU still runs the previous step's optimizer, as a training loop runs
  // and as the transformers anchor is timed (shared/tools/hf_anchor.py's sync_time).
  BackToBackSteps block;
  engine.text_model().timer().set_enabled(false);
  CUDA_CHECK(cudaDeviceSynchronize());
  block.before = ResourceSnapshot::take();
  const auto start = std::chrono::steady_clock::now();
  double tokens = 0;
  // cudaMemGetInfo does not wait for the device: a change shows at the step that caused it or
  // shortly after.
  size_t free_in_block = block.before.free_bytes;
  const int64_t first = schedule.warmup + schedule.steps;
  for (int64_t step = 0; step < schedule.steps; ++step) {
    const std::vector<MicroBatch>& batches = schedule.step(first + step);
    const StepResult result = engine.train_step(batches, 1e-5, 1.0);
    CHECK(!result.skipped && result.num_supervised > 0 && std::isfinite(result.ce_sum),
          "bench: the loss or the gradient norm is not finite at back-to-back step ", step + 1);
    for (const MicroBatch& batch : batches) tokens += static_cast<double>(batch.num_tokens());
    const size_t free_bytes = free_device_bytes();
    if (free_bytes != free_in_block && rank == 0) {
      const PackingShape shape = packing_shape(batches);
      block.memory_changes += str_cat("back-to-back step ", step + 1, " (", result.num_tokens, " tokens in ",
                                      shape.samples, " samples, longest ", shape.longest, "): GPU memory in use ",
                                      static_cast<int64_t>(free_in_block) - static_cast<int64_t>(free_bytes),
                                      " bytes\n");
    }
    free_in_block = free_bytes;
  }
  CUDA_CHECK(cudaDeviceSynchronize());
  const double block_ms = elapsed_ms(start);
  block.ms_per_step = block_ms / static_cast<double>(schedule.steps);
  block.tokens_per_s = tokens / (block_ms / 1e3);
  return block;
}

}  // namespace deltamoe
