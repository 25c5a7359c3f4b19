// Expert-parallel row exchange: counts through an all-to-all, rows through grouped send/recv with
// exact counts (a rank's rows to itself go through the same path, a copy on host backends).
#include "parallel/expert_dispatch.h"

#include <cstring>

#include "core/error.h"

namespace deltamoe {

namespace {

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) offsets[i + 1] = offsets[i] + counts[i];
  return offsets;
}

}  // namespace

ExpertDispatcher::ExpertDispatcher(Communicator& ep, int64_t num_experts) : ep_(ep), num_experts_(num_experts) {
  CHECK(num_experts > 0 && num_experts % ep.size() == 0, "expert parallel: ", num_experts,
        " routed experts cannot be split evenly over --expert_model_parallel_size ", ep.size());
  experts_per_rank_ = num_experts / ep.size();
}

ExpertDispatchPlan ExpertDispatcher::plan(const int32_t* topk_idx, int64_t num_tokens, int64_t top_k) const {
  CHECK(num_tokens >= 0 && top_k > 0, "expert dispatch: bad shape [", num_tokens, ", ", top_k, "]");
  CHECK(num_tokens == 0 || topk_idx != nullptr, "expert dispatch: topk_idx is null for ", num_tokens, " tokens");
  const int n = ep_.size();
  ExpertDispatchPlan plan;
  plan.num_tokens = num_tokens;
  plan.top_k = top_k;
  plan.send_counts.assign(n, 0);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t k = 0; k < top_k; ++k) {
      const int32_t e = topk_idx[t * top_k + k];
      CHECK(e >= 0 && e < num_experts_, "expert dispatch: token ", t, " slot ", k, " routes to expert ", e,
            ", outside [0, ", num_experts_, ")");
      for (int64_t j = 0; j < k; ++j) {
        CHECK(topk_idx[t * top_k + j] != e, "expert dispatch: token ", t, " chooses expert ", e, " twice (slots ", j,
              " and ", k, ")");
      }
      ++plan.send_counts[owner(e)];
    }
  }
  // Send order (destination, token, slot): a stable bucket pass over the slots.
  std::vector<int64_t> cursor = offsets_of(plan.send_counts);
  plan.send_slot.resize(static_cast<size_t>(num_tokens * top_k));
  std::vector<int32_t> send_expert(plan.send_slot.size());
  for (int64_t s = 0; s < num_tokens * top_k; ++s) {
    const int64_t pos = cursor[owner(topk_idx[s])]++;
    plan.send_slot[pos] = s;
    send_expert[pos] = topk_idx[s];
  }
  plan.recv_counts.assign(n, 0);
  ep_.all_to_all(plan.send_counts.data(), plan.recv_counts.data(), 1, DType::i64);
  const std::vector<int64_t> send_off = offsets_of(plan.send_counts), recv_off = offsets_of(plan.recv_counts);
  plan.recv_expert.resize(static_cast<size_t>(recv_off[n]));
  ep_.group_start();
  for (int p = 0; p < n; ++p) {
    ep_.send(send_expert.data() + send_off[p], plan.send_counts[p], DType::i32, p);
    ep_.recv(plan.recv_expert.data() + recv_off[p], plan.recv_counts[p], DType::i32, p);
  }
  ep_.group_end();
  for (int32_t e : plan.recv_expert) {
    CHECK(owner(e) == ep_.rank(), "expert dispatch: rank ", ep_.rank(), " received a row for expert ", e,
          " that it does not own");
  }
  return plan;
}

void ExpertDispatcher::dispatch(const ExpertDispatchPlan& plan, const float* rows, int64_t width, bool per_slot,
                                float* recv) const {
  const int n = ep_.size();
  const size_t row_bytes = static_cast<size_t>(width) * sizeof(float);
  std::vector<float> send(plan.send_slot.size() * static_cast<size_t>(width));
  for (size_t i = 0; i < plan.send_slot.size(); ++i) {
    const int64_t source_row = per_slot ? plan.send_slot[i] : plan.send_slot[i] / plan.top_k;
    std::memcpy(send.data() + i * width, rows + source_row * width, row_bytes);
  }
  const std::vector<int64_t> send_off = offsets_of(plan.send_counts), recv_off = offsets_of(plan.recv_counts);
  ep_.group_start();
  for (int p = 0; p < n; ++p) {
    ep_.send(send.data() + send_off[p] * width, plan.send_counts[p] * width, DType::f32, p);
    ep_.recv(recv + recv_off[p] * width, plan.recv_counts[p] * width, DType::f32, p);
  }
  ep_.group_end();
}

void ExpertDispatcher::combine(const ExpertDispatchPlan& plan, const float* recv_rows, int64_t width,
                               float* slot_rows) const {
  const int n = ep_.size();
  const size_t row_bytes = static_cast<size_t>(width) * sizeof(float);
  std::vector<float> back(plan.send_slot.size() * static_cast<size_t>(width));
  const std::vector<int64_t> send_off = offsets_of(plan.send_counts), recv_off = offsets_of(plan.recv_counts);
  ep_.group_start();
  for (int p = 0; p < n; ++p) {
    ep_.send(recv_rows + recv_off[p] * width, plan.recv_counts[p] * width, DType::f32, p);
    ep_.recv(back.data() + send_off[p] * width, plan.send_counts[p] * width, DType::f32, p);
  }
  ep_.group_end();
  for (size_t i = 0; i < plan.send_slot.size(); ++i) {
    std::memcpy(slot_rows + plan.send_slot[i] * width, back.data() + i * width, row_bytes);
  }
}

}  // namespace deltamoe
