// Floors of a training step by component (step_floors.h).
#include "train/step_floors.h"

#include <algorithm>

#include "core/error.h"
#include "train/model_flops.h"

namespace deltamoe {

double ComponentFloor::ms(double flops_per_second, double bytes_per_second) const {
  CHECK(flops_per_second > 0 && bytes_per_second > 0, "step floors: rates must be positive");
  return 1e3 * std::max(flops / flops_per_second, bytes / bytes_per_second);
}

ComponentFloor& ComponentFloor::operator+=(const ComponentFloor& other) {
  flops += other.flops;
  bytes += other.bytes;
  return *this;
}

StepFloors& StepFloors::operator+=(const StepFloors& other) {
  gdn += other.gdn;
  attention += other.attention;
  moe += other.moe;
  lm_head_loss += other.lm_head_loss;
  return *this;
}

StepFloors micro_batch_floors(const TextConfig& c, const std::vector<int32_t>& cu_seqlens, bool text_trained,
                              int64_t lm_head_rows) {
  CHECK(cu_seqlens.size() >= 2, "step floors: cu_seqlens needs at least two entries");
  const double tokens = static_cast<double>(cu_seqlens.back() - cu_seqlens.front());
  CHECK(lm_head_rows >= -1 && static_cast<double>(lm_head_rows) <= tokens, "step floors: ", lm_head_rows,
        " lm_head rows of ", tokens, " tokens");
  const double head_rows = lm_head_rows < 0 ? tokens : static_cast<double>(lm_head_rows);
  const MatmulParamsByPart per_token = matmul_params_by_part(c);
  // Bytes per matmul weight: read by the forward and the backward, and the gradient written (fp32;
  // the routed experts' bf16).
  const double weight_bytes = 2.0 + 2.0 + (text_trained ? 4.0 : 0.0);
  const double routed_expert_bytes = 2.0 + 2.0 + (text_trained ? 2.0 : 0.0);
  const double gdn_layers = static_cast<double>(c.num_layers_of(LayerType::linear_attention));
  const double attention_layers = static_cast<double>(c.num_layers_of(LayerType::full_attention));
  const double layers = static_cast<double>(c.num_hidden_layers);
  // Every routed expert's weights are read (and their gradients written), not only the top-k's.
  const int64_t C = c.hidden_size;
  const double routed_weights = static_cast<double>(c.num_experts * 3 * c.moe_intermediate_size * C);
  const double other_moe_weights =
      static_cast<double>(3 * c.shared_expert_intermediate_size * C + C + c.num_experts * C);

  StepFloors f;
  f.gdn.flops = 6.0 * static_cast<double>(per_token.gdn) * tokens * gdn_layers;
  f.gdn.bytes = weight_bytes * static_cast<double>(per_token.gdn) * gdn_layers;
  f.attention.flops =
      (6.0 * static_cast<double>(per_token.attention) * tokens + attention_core_flops(c, cu_seqlens)) *
      attention_layers;
  f.attention.bytes = weight_bytes * static_cast<double>(per_token.attention) * attention_layers;
  f.moe.flops = 6.0 * static_cast<double>(per_token.moe) * tokens * layers;
  f.moe.bytes = (routed_expert_bytes * routed_weights + weight_bytes * other_moe_weights) * layers;
  f.lm_head_loss.flops = 6.0 * static_cast<double>(per_token.lm_head) * head_rows;
  f.lm_head_loss.bytes = weight_bytes * static_cast<double>(per_token.lm_head);
  return f;
}

double memory_bytes_per_second(int64_t memory_clock_khz, int64_t bus_width_bits) {
  if (memory_clock_khz <= 0 || bus_width_bits <= 0) return 0.0;
  return 2.0 * static_cast<double>(memory_clock_khz) * 1e3 * static_cast<double>(bus_width_bits) / 8.0;
}

ComponentFloor adamw_floor(int64_t trained_params, DType moment_dtype, int64_t split_params) {
  CHECK(trained_params >= 0, "step floors: negative trained parameter count ", trained_params);
  CHECK(split_params >= 0 && split_params <= trained_params, "step floors: ", split_params,
        " split masters among ", trained_params, " trained parameters");
  const double moment_bytes = static_cast<double>(dtype_size(moment_dtype));
  ComponentFloor f;
  f.bytes = (4.0 + 4.0 + 4.0 + 4.0 * moment_bytes + 2.0) * static_cast<double>(trained_params) -
            4.0 * static_cast<double>(split_params);
  return f;
}

}  // namespace deltamoe
