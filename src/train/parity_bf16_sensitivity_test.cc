// How well-conditioned each golden case is for bf16 (why the GPU's gradients can or cannot meet 2e-2):
// the fp32 CPU reference rerun with every weight rounded to bf16 once, with its routers free and
// with routing forced to the unrounded run's choices. Prints, per case and loss, the tokens whose
// expert set flipped and the worst gradient move in both runs. Asserts that forcing a run's own
// routing changes nothing, and that the *_router_margin cases (built to be well-conditioned) flip no
// token and move no gradient past kConditionedMove. Label cpu, not golden: it reads the golden
// cases' models and inputs but compares with no transformers output.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <tuple>

#include "checkpoint/model_checkpoint.h"
#include "train/golden_cases_test_util.h"
#include "train/parity.h"
#include "train/parity_sensitivity.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

constexpr double kGradRatio = 2e-2;  // the GPU acceptance bound on every gradient (issue #7)
// Worst gradient move under bf16-rounded weights that a *_router_margin case may show. Measured on
// text_two_rows' / vlm_two_images' weights and inputs with matrices scaled to gain 0.3 (as those
// cases are built): worst 1.7e-2 / 2.3e-2; at gain 1 the same cases move 0.25 / 0.28. 5e-2 keeps 2x.
constexpr double kConditionedMove = 5e-2;

using golden_test::golden_cases;

struct MoveSummary {
  double worst = 0;
  std::string worst_name = "(none)";
  int over = 0;
  size_t count = 0;
};

MoveSummary summarize(const std::map<std::string, double>& distances) {
  MoveSummary summary;
  summary.count = distances.size();
  for (const auto& [name, distance] : distances) {
    const double score = std::isfinite(distance) ? distance : INFINITY;
    summary.over += score > kGradRatio;
    if (score > summary.worst || summary.worst_name == "(none)") summary.worst = score, summary.worst_name = name;
  }
  return summary;
}

void print_moves(const std::string& label, const ParityResult& run, const ParityResult& ref) {
  for (const auto& [kind, ours, theirs] : {std::tuple{"grad", &run.grads, &ref.grads},
                                           std::tuple{"grad_aux", &run.grads_aux, &ref.grads_aux}}) {
    const MoveSummary s = summarize(gradient_distances(*ours, *theirs));
    std::printf("    %-34s %-8s worst %.3e (%s), %d of %zu over %.0e\n", label.c_str(), kind, s.worst,
                s.worst_name.c_str(), s.over, s.count, kGradRatio);
  }
}

TEST(ParityBf16Sensitivity, RoutingFlipsAndWeightRounding) {
  const std::vector<fs::path> cases = golden_cases();
  ASSERT_FALSE(cases.empty()) << "no golden cases under tests/golden";
  for (const fs::path& dir : cases) {
    const std::string name = dir.filename().string();
    SCOPED_TRACE(name);
    const ModelCheckpoint checkpoint = load_model_dir((dir / "model").string());
    const ModelCheckpoint rounded = with_bf16_rounded_weights(checkpoint);
    const ParityInputs inputs = load_parity_inputs((dir / "inputs.safetensors").string());
    const int64_t top_k = checkpoint.config.text.num_experts_per_tok;
    const int64_t pairs = checkpoint.config.text.num_hidden_layers * inputs.input_ids.numel();

    const ParityResult exact = run_parity_cpu(checkpoint, inputs);
    ParityInputs pinned_inputs = inputs;
    pinned_inputs.forced_routing = exact.routing;
    // Forcing the routers' own choices must reproduce the free run bit for bit.
    const ParityResult self_pinned = run_parity_cpu(checkpoint, pinned_inputs);
    for (const auto& [tensor, distance] : gradient_distances(self_pinned.grads, exact.grads))
      EXPECT_EQ(distance, 0.0) << name << ": forcing the run's own routing moved grad." << tensor;
    EXPECT_EQ(self_pinned.ce_loss, exact.ce_loss);

    const ParityResult free_run = run_parity_cpu(rounded, inputs);
    const ParityResult pinned_run = run_parity_cpu(rounded, pinned_inputs);
    const int64_t flips = routing_differences(free_run.routing, exact.routing, top_k);
    std::printf("%s: bf16-rounded weights flip the expert set of %lld of %lld (layer, token) pairs; ce_loss rel "
                "%.2e free, %.2e pinned\n",
                name.c_str(), static_cast<long long>(flips), static_cast<long long>(pairs),
                std::abs(free_run.ce_loss - exact.ce_loss) / std::abs(exact.ce_loss),
                std::abs(pinned_run.ce_loss - exact.ce_loss) / std::abs(exact.ce_loss));
    print_moves("bf16 weights, routers free", free_run, exact);
    print_moves("bf16 weights, routing pinned", pinned_run, exact);

    if (name.size() > 14 && name.compare(name.size() - 14, 14, "_router_margin") == 0) {
      // Built to be well-conditioned: one bf16 rounding of the weights must flip no token, and
      // move no gradient past kConditionedMove.
      EXPECT_EQ(flips, 0) << name << ": a well-conditioned case flips routing under bf16 weights";
      for (const bool ce : {true, false}) {
        for (const auto& [tensor, distance] :
             gradient_distances(ce ? free_run.grads : free_run.grads_aux, ce ? exact.grads : exact.grads_aux))
          EXPECT_LE(distance, kConditionedMove) << name << ": bf16 weights move " << (ce ? "grad." : "grad_aux.")
                                                << tensor;
      }
    }
  }
}

}  // namespace
}  // namespace deltamoe
