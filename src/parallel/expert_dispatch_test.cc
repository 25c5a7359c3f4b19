// ExpertDispatcher over ThreadComm: rows reach the owner of their expert in (source, token, slot)
// order, come back to their (token, slot), and the edge cases (a rank without tokens, every row
// to one rank, one token, bad routing) behave.
#include "parallel/expert_dispatch.h"

#include <gtest/gtest.h>

#include <mutex>
#include <vector>

#include "parallel/thread_comm.h"

namespace deltamoe {
namespace {

constexpr int64_t kWidth = 3;

// The value of column c of token t of rank r: unique, exactly representable.
float token_value(int r, int64_t t, int64_t c) { return static_cast<float>(r * 10000 + t * 10 + c); }

// Routing of rank r: token t picks experts (t + r + 3k) mod E for slot k (distinct for K <= E/3).
std::vector<int32_t> routing(int r, int64_t tokens, int64_t k, int64_t experts) {
  std::vector<int32_t> idx;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t s = 0; s < k; ++s) idx.push_back(static_cast<int32_t>((t + r + 3 * s) % experts));
  return idx;
}

// Every rank dispatches its token rows, the owner tags each received row with its expert id and
// returns it; each source checks every (token, slot) got its own row back with its expert's tag, and
// each owner checks its rows arrived in (source, token, slot) order.
void round_trip(int ranks, int64_t experts, int64_t top_k, const std::vector<int64_t>& tokens_of_rank,
                const std::function<std::vector<int32_t>(int, int64_t)>& route) {
  run_thread_comm(ranks, [&](Communicator& comm) {
    const int r = comm.rank();
    const int64_t T = tokens_of_rank[r];
    ExpertDispatcher ep(comm, experts);
    const std::vector<int32_t> idx = route(r, T);
    std::vector<float> x(T * kWidth);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < kWidth; ++c) x[t * kWidth + c] = token_value(r, t, c);
    const ExpertDispatchPlan plan = ep.plan(idx.data(), T, top_k);
    std::vector<float> recv(plan.recv_rows() * kWidth);
    ep.dispatch(plan, x.data(), kWidth, false, recv.data());
    // Expected receive order: for each source s, its (t, slot) in order whose expert this rank owns.
    int64_t row = 0;
    for (int s = 0; s < ranks; ++s) {
      const std::vector<int32_t> their = route(s, tokens_of_rank[s]);
      for (int64_t t = 0; t < tokens_of_rank[s]; ++t) {
        for (int64_t k = 0; k < top_k; ++k) {
          const int32_t e = their[t * top_k + k];
          if (ep.owner(e) != r) continue;
          ASSERT_LT(row, plan.recv_rows());
          EXPECT_EQ(plan.recv_expert[row], e);
          for (int64_t c = 0; c < kWidth; ++c) EXPECT_EQ(recv[row * kWidth + c], token_value(s, t, c));
          ++row;
        }
      }
    }
    EXPECT_EQ(row, plan.recv_rows());
    for (int64_t i = 0; i < plan.recv_rows(); ++i) recv[i * kWidth] += 1000.0f * static_cast<float>(plan.recv_expert[i]);
    std::vector<float> back(T * top_k * kWidth, -1.0f);
    ep.combine(plan, recv.data(), kWidth, back.data());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t k = 0; k < top_k; ++k) {
        const float* got = back.data() + (t * top_k + k) * kWidth;
        EXPECT_EQ(got[0], token_value(r, t, 0) + 1000.0f * static_cast<float>(idx[t * top_k + k]));
        for (int64_t c = 1; c < kWidth; ++c) EXPECT_EQ(got[c], token_value(r, t, c));
      }
    }
  });
}

TEST(ExpertDispatch, RowsReachTheirOwnerInSourceTokenSlotOrderAndReturn) {
  for (int ranks : {1, 2, 4, 8}) {
    SCOPED_TRACE(ranks);
    round_trip(ranks, 8, 2, std::vector<int64_t>(ranks, 5), [](int r, int64_t T) { return routing(r, T, 2, 8); });
  }
}

TEST(ExpertDispatch, ARankWithoutTokensOneTokenAndEveryRowToOneRank) {
  // Rank 1 has no tokens, rank 2 one.
  round_trip(4, 8, 2, {6, 0, 1, 3}, [](int r, int64_t T) { return routing(r, T, 2, 8); });
  // Every token picks experts 0 and 1, both owned by rank 0 of 4.
  round_trip(4, 8, 2, {3, 2, 4, 1}, [](int, int64_t T) {
    std::vector<int32_t> idx;
    for (int64_t t = 0; t < T; ++t) idx.insert(idx.end(), {1, 0});
    return idx;
  });
}

TEST(ExpertDispatch, PerSlotRowsCarryTheirOwnValues) {
  run_thread_comm(2, [](Communicator& comm) {
    ExpertDispatcher ep(comm, 4);
    const std::vector<int32_t> idx = {0, 3, 2, 1};  // 2 tokens, K = 2
    const std::vector<float> rows = {10, 11, 12, 13};  // one value per (token, slot)
    const ExpertDispatchPlan plan = ep.plan(idx.data(), 2, 2);
    std::vector<float> recv(plan.recv_rows());
    ep.dispatch(plan, rows.data(), 1, true, recv.data());
    // Rank 0 owns experts 0, 1: slot (0,0) and (1,1) of each rank; rank 1 owns 2, 3.
    const std::vector<float> want = comm.rank() == 0 ? std::vector<float>{10, 13, 10, 13} : std::vector<float>{11, 12, 11, 12};
    EXPECT_EQ(recv, want);
  });
}

TEST(ExpertDispatch, BadRoutingIsRefusedWithTheToken) {
  std::mutex mutex;
  std::vector<std::string> messages;
  auto expect_refused = [&](std::vector<int32_t> idx, const std::string& needle) {
    run_thread_comm(1, [&](Communicator& comm) {
      ExpertDispatcher ep(comm, 4);
      try {
        ep.plan(idx.data(), static_cast<int64_t>(idx.size()) / 2, 2);
        ADD_FAILURE() << "accepted " << needle;
      } catch (const Error& error) {
        EXPECT_NE(std::string(error.what()).find(needle), std::string::npos) << error.what();
      }
    });
  };
  expect_refused({0, 1, 2, 2}, "token 1 chooses expert 2 twice");
  expect_refused({0, 4}, "token 0 slot 1 routes to expert 4");
  expect_refused({-1, 0}, "token 0 slot 0 routes to expert -1");
  EXPECT_THROW(run_thread_comm(2, [](Communicator& comm) { ExpertDispatcher ep(comm, 3); }), Error);
}

}  // namespace
}  // namespace deltamoe
