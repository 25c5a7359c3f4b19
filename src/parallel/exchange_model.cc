// The exchange model (exchange_model.h).
#include "parallel/exchange_model.h"

#include <cstdio>

#include "core/error.h"

namespace deltamoe {

ExchangeModel model_exchange(const ExchangeModelInput& in) {
  CHECK(in.ranks >= 1 && in.tokens_per_rank >= 0 && in.top_k >= 1 && in.hidden >= 1 && in.layers >= 0 &&
            in.micro_batches >= 1 && in.link_bytes_per_s > 0 && in.imbalance >= 1.0,
        "exchange model: bad input");
  ExchangeModel out;
  const double off_rank = static_cast<double>(in.ranks - 1) / static_cast<double>(in.ranks);
  // Uniform routing: a slot stays on this rank with probability 1/N. Rows are bf16 of `hidden`; the
  // routing weight (f32) and expert id (i32) of a row travel with the forward dispatch.
  const double rows = static_cast<double>(in.tokens_per_rank * in.top_k) * off_rank;
  const double row_bytes = 2.0 * static_cast<double>(in.hidden);
  out.exchange_bytes = static_cast<double>(in.layers) * rows * (row_bytes * in.exchanges_per_layer + 8.0);
  out.imbalance = in.imbalance;
  out.exchange_seconds = out.exchange_bytes / in.link_bytes_per_s * in.imbalance;
  out.reduce_scatter_bytes = in.dense_trained_elements * 4.0 * off_rank;
  out.all_gather_bytes = in.dense_trained_elements * 2.0 * off_rank;
  out.reduce_scatter_seconds = out.reduce_scatter_bytes / in.link_bytes_per_s;
  out.all_gather_seconds = out.all_gather_bytes / in.link_bytes_per_s;
  return out;
}

double ExchangeModel::predicted_step_seconds(double compute_seconds, int64_t micro_batches) const {
  return compute_seconds * imbalance + static_cast<double>(micro_batches) * exchange_seconds + reduce_scatter_seconds +
         all_gather_seconds;
}

std::string ExchangeModel::describe() const {
  char line[400];
  std::snprintf(line, sizeof(line),
                "exchange %.2f GB per micro-batch (%.1f ms), reduce-scatter %.2f GB (%.1f ms) and all-gather %.2f GB "
                "(%.1f ms) per step",
                exchange_bytes / 1e9, exchange_seconds * 1e3, reduce_scatter_bytes / 1e9,
                reduce_scatter_seconds * 1e3, all_gather_bytes / 1e9, all_gather_seconds * 1e3);
  return line;
}

}  // namespace deltamoe
