// What a run reports: the one-line progress (step/total, loss, lr, grad norm, tokens/s, ETA), one
// JSON object per line in output_dir/metrics.jsonl, and the summary at the end.
#pragma once

#include <cstdint>
#include <string>

namespace deltamoe {

struct StepMetrics {
  int64_t step = 0;  // 1-based: steps done after this one
  int64_t total_steps = 0;
  int64_t epoch = 0;
  double loss = 0;      // ce_loss + weighted aux loss
  double ce_loss = 0;   // token mean over the global batch
  double aux_loss = 0;  // coefficient * mean aux over micro-batches
  double lr = 0;
  double grad_norm = 0;
  double token_acc = -1;  // supervised tokens predicted right (teacher forcing); -1: not computed
  bool skipped = false;
  int64_t num_tokens = 0;
  int64_t num_supervised = 0;
  int64_t num_images = 0;        // images in the step's micro-batches
  int64_t num_image_tokens = 0;  // their tokens in the sequences (after the spatial merge)
  double step_s = 0;
  double data_wait_s = 0;  // part of step_s spent waiting for the step's micro-batches
  double tokens_per_s = 0;
  double eta_s = 0;
  double elapsed_s = 0;
  // GPU engine only (negative: not reported, left out of the line and the file).
  double tflops = -1;        // model TFLOP/s of the step (training_step_flops, model_flops.h, / step_s)
  double mfu = -1;           // tflops / the device's peak (needs a known peak: --peak_tflops or the GPU name)
  double peak_mem_gib = -1;  // most device memory in use so far (GiB, CUDA context included)
  // Bytes the step copied host -> device and device -> host (batches in; losses and the norm out).
  int64_t h2d_bytes = -1, d2h_bytes = -1;
};

// "step 12/100 | loss 3.2104 | acc 0.412 | lr 9.51e-05 | grad_norm 1.234 | 2.1k tok/s | 0.41 s/step | ETA 36s"
// (acc: token accuracy of the step's supervised tokens, when the engine reports it). The GPU
// engine adds "| MFU 41.2% (407 TFLOP/s) | mem 61.3 GiB | h2d 1.2 MB d2h 96 B" after tok/s
// ("| 407 TFLOP/s" without a peak).
std::string format_progress_line(const StepMetrics& metrics);
// "1h02m", "3m05s", "12s".
std::string format_duration(double seconds);
// Peak dense bf16 TFLOP/s of a GPU from its name (cudaDeviceProp::name), as the spec sheets give
// them without sparsity: H100/H200/H800/GH200 989 (SXM; "PCIe" H100 756), A100/A800 312, L40S 362,
// B200 2250; 0 when unknown (then MFU is left out unless --peak_tflops names it).
double default_peak_tflops(const std::string& gpu_name);

// Appends JSON lines to a file opened with O_APPEND, one write() per line, so a crash loses at
// most the line being written and never tears another's.
class MetricsLog {
 public:
  // keep_up_to_step < 0: start a new file. Otherwise (a resumed run) keep the earlier lines of
  // steps <= keep_up_to_step and drop later ones, which a run killed after its last checkpoint
  // wrote and the resumed run is about to write again. Either way the file is replaced through
  // path.tmp + fsync + rename, so a kill at any moment leaves the old or the new file, never a
  // truncated one.
  MetricsLog(const std::string& path, int64_t keep_up_to_step);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  void write_step(const StepMetrics& metrics);
  // token_acc < 0 is written as null.
  void write_eval(int64_t step, double val_loss, double token_acc, int64_t num_supervised);
  const std::string& path() const { return path_; }

 private:
  void write_line(const std::string& line);
  std::string path_;
  int fd_ = -1;
};

}  // namespace deltamoe
