// Tests of the gated delta rule references: recurrent and chunked backward against fp64 central
// finite differences, chunked vs recurrent in fp32 (across chunk boundaries, with initial state),
// packed vs one-sequence-at-a-time, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "kernels/gated_delta_rule/gated_delta_rule.h"
#include "kernels/gated_delta_rule/gradient_check_test_util.h"

namespace deltamoe {
namespace {

using gdn_test::compare;
using gdn_test::random_uniform;

enum class Form { recurrent, chunked };

const char* form_name(Form form) { return form == Form::recurrent ? "recurrent" : "chunked"; }

struct Dims {
  std::vector<int> lengths;
  int key_heads, value_heads, key_dim, value_dim;
};

// Inputs, output cotangents and results of one problem, in scalar type S.
template <typename S>
struct Problem {
  Dims dims;
  std::vector<int32_t> cu_seqlens;
  int64_t tokens = 0;
  S scale = 0;
  std::vector<S> q, k, v, g, beta, initial_state;  // initial_state empty = none
  std::vector<S> d_o, d_final_state;               // d_final_state empty = none

  GatedDeltaRuleShape shape() const {
    return {cu_seqlens.data(),
            static_cast<int>(dims.lengths.size()),
            tokens,
            dims.key_heads,
            dims.value_heads,
            dims.key_dim,
            dims.value_dim};
  }
  int64_t state_numel() const {
    return static_cast<int64_t>(dims.lengths.size()) * dims.value_heads * dims.key_dim *
           dims.value_dim;
  }
};

// Rows of x [R, D] scaled to unit norm (the op's inputs are l2-normalised q and k).
std::vector<double> unit_rows(std::vector<double> x, int dim) {
  for (size_t r = 0; r * dim < x.size(); ++r) {
    double sum_sq = 0;
    for (int d = 0; d < dim; ++d) sum_sq += x[r * dim + d] * x[r * dim + d];
    for (int d = 0; d < dim; ++d) x[r * dim + d] /= std::sqrt(sum_sq);
  }
  return x;
}

// g is drawn from [g_min, 0]: the default decays mildly; a very negative g_min (strong decay,
// exp(gamma) underflowing inside a chunk) exercises the chunked form's numerics.
Problem<double> make_problem(const Dims& dims, bool with_initial_state, bool with_d_final_state,
                             uint64_t seed, double g_min = -0.4) {
  Problem<double> p;
  p.dims = dims;
  p.cu_seqlens = {0};
  for (int length : dims.lengths) p.cu_seqlens.push_back(p.cu_seqlens.back() + length);
  p.tokens = p.cu_seqlens.back();
  p.scale = 1.0 / std::sqrt(static_cast<double>(dims.key_dim));
  const int64_t qk_numel = p.tokens * dims.key_heads * dims.key_dim;
  const int64_t v_numel = p.tokens * dims.value_heads * dims.value_dim;
  const int64_t gate_numel = p.tokens * dims.value_heads;
  p.q = unit_rows(random_uniform(qk_numel, -1, 1, seed + 1), dims.key_dim);
  p.k = unit_rows(random_uniform(qk_numel, -1, 1, seed + 2), dims.key_dim);
  p.v = random_uniform(v_numel, -1, 1, seed + 3);
  p.g = random_uniform(gate_numel, g_min, 0.0, seed + 4);
  p.beta = random_uniform(gate_numel, 0.05, 0.95, seed + 5);
  if (with_initial_state) p.initial_state = random_uniform(p.state_numel(), -1, 1, seed + 6);
  p.d_o = random_uniform(v_numel, -1, 1, seed + 7);
  if (with_d_final_state) p.d_final_state = random_uniform(p.state_numel(), -1, 1, seed + 8);
  return p;
}

template <typename S>
Problem<S> cast_problem(const Problem<double>& p) {
  Problem<S> out;
  out.dims = p.dims;
  out.cu_seqlens = p.cu_seqlens;
  out.tokens = p.tokens;
  out.scale = static_cast<S>(p.scale);
  auto cast = [](const std::vector<double>& x) { return std::vector<S>(x.begin(), x.end()); };
  out.q = cast(p.q), out.k = cast(p.k), out.v = cast(p.v), out.g = cast(p.g);
  out.beta = cast(p.beta), out.initial_state = cast(p.initial_state);
  out.d_o = cast(p.d_o), out.d_final_state = cast(p.d_final_state);
  return out;
}

template <typename S>
const S* or_null(const std::vector<S>& x) {
  return x.empty() ? nullptr : x.data();
}

template <typename S>
struct Outputs {
  std::vector<S> o, final_state;
};

template <typename S>
Outputs<S> run_forward(Form form, const Problem<S>& p, int chunk_size = kGatedDeltaRuleChunkSize) {
  Outputs<S> out;
  out.o.assign(p.tokens * p.dims.value_heads * p.dims.value_dim, S(0));
  out.final_state.assign(p.state_numel(), S(0));
  if (form == Form::recurrent) {
    gated_delta_rule_recurrent_forward_ref(p.shape(), p.scale, p.q.data(), p.k.data(), p.v.data(),
                                           p.g.data(), p.beta.data(), or_null(p.initial_state),
                                           out.o.data(), out.final_state.data());
  } else {
    gated_delta_rule_chunked_forward_ref(p.shape(), p.scale, p.q.data(), p.k.data(), p.v.data(),
                                         p.g.data(), p.beta.data(), or_null(p.initial_state),
                                         out.o.data(), out.final_state.data(), chunk_size);
  }
  return out;
}

template <typename S>
struct Grads {
  std::vector<S> dq, dk, dv, dg, dbeta, d_initial_state;
};

template <typename S>
Grads<S> run_backward(Form form, const Problem<S>& p, int chunk_size = kGatedDeltaRuleChunkSize) {
  Grads<S> gr;
  // Filled with NaN so that any entry the backward fails to write makes the comparison fail.
  const S nan = std::nan("");
  gr.dq.assign(p.q.size(), nan), gr.dk.assign(p.k.size(), nan), gr.dv.assign(p.v.size(), nan);
  gr.dg.assign(p.g.size(), nan), gr.dbeta.assign(p.beta.size(), nan);
  gr.d_initial_state.assign(p.state_numel(), nan);
  if (form == Form::recurrent) {
    gated_delta_rule_recurrent_backward_ref(
        p.shape(), p.scale, p.q.data(), p.k.data(), p.v.data(), p.g.data(), p.beta.data(),
        or_null(p.initial_state), p.d_o.data(), or_null(p.d_final_state), gr.dq.data(),
        gr.dk.data(), gr.dv.data(), gr.dg.data(), gr.dbeta.data(), gr.d_initial_state.data());
  } else {
    gated_delta_rule_chunked_backward_ref(p.shape(), p.scale, p.q.data(), p.k.data(), p.v.data(),
                                          p.g.data(), p.beta.data(), or_null(p.initial_state),
                                          p.d_o.data(), or_null(p.d_final_state), gr.dq.data(),
                                          gr.dk.data(), gr.dv.data(), gr.dg.data(), gr.dbeta.data(),
                                          gr.d_initial_state.data(), chunk_size);
  }
  return gr;
}

std::string describe(const Dims& dims) {
  std::ostringstream text;
  text << "lengths {";
  for (size_t i = 0; i < dims.lengths.size(); ++i) text << (i ? "," : "") << dims.lengths[i];
  text << "} Hk=" << dims.key_heads << " Hv=" << dims.value_heads << " Dk=" << dims.key_dim
       << " Dv=" << dims.value_dim;
  return text.str();
}

// Checks every gradient of `form` against central differences of its own forward in fp64,
// with loss = <o, d_o> + <final_state, d_final_state>.
void check_against_finite_differences(Form form, const Dims& dims, int chunk_size, uint64_t seed) {
  Problem<double> p =
      make_problem(dims, /*with_initial_state=*/true, /*with_d_final_state=*/true, seed);
  std::printf("%s chunk=%d %s\n", form_name(form), chunk_size, describe(dims).c_str());
  auto loss = [&] {
    const Outputs<double> out = run_forward(form, p, chunk_size);
    return gdn_test::dot(out.o, p.d_o) + gdn_test::dot(out.final_state, p.d_final_state);
  };
  const Grads<double> gr = run_backward(form, p, chunk_size);
  constexpr double kTolerance = 1e-6;
  EXPECT_LT(compare("dq", gr.dq, gdn_test::finite_difference(p.q, loss)).rel_or_abs(), kTolerance);
  EXPECT_LT(compare("dk", gr.dk, gdn_test::finite_difference(p.k, loss)).rel_or_abs(), kTolerance);
  EXPECT_LT(compare("dv", gr.dv, gdn_test::finite_difference(p.v, loss)).rel_or_abs(), kTolerance);
  EXPECT_LT(compare("dg", gr.dg, gdn_test::finite_difference(p.g, loss)).rel_or_abs(), kTolerance);
  EXPECT_LT(compare("dbeta", gr.dbeta, gdn_test::finite_difference(p.beta, loss)).rel_or_abs(),
            kTolerance);
  EXPECT_LT(compare("d_initial_state", gr.d_initial_state,
                    gdn_test::finite_difference(p.initial_state, loss))
                .rel_or_abs(),
            kTolerance);
}

const std::vector<Dims>& gradient_check_dims() {
  static const std::vector<Dims> dims = {
      {{1}, 1, 1, 3, 2},                  // T = 1
      {{5}, 1, 1, 1, 1},                  // scalar state
      {{3, 7}, 2, 4, 5, 3},               // GQA (two value heads per key head), odd dims
      {{1, 63, 64, 65, 130}, 1, 2, 3, 2}  // chunk edges: shorter, equal, one over, two chunks + 2
  };
  return dims;
}

TEST(GatedDeltaRuleRef, RecurrentBackwardMatchesFiniteDifferences) {
  uint64_t seed = 100;
  for (const Dims& dims : gradient_check_dims()) {
    check_against_finite_differences(Form::recurrent, dims, kGatedDeltaRuleChunkSize, seed += 10);
  }
}

TEST(GatedDeltaRuleRef, ChunkedBackwardMatchesFiniteDifferences) {
  uint64_t seed = 200;
  for (const Dims& dims : gradient_check_dims()) {
    check_against_finite_differences(Form::chunked, dims, kGatedDeltaRuleChunkSize, seed += 10);
  }
  // Small chunks put many chunk boundaries (and partial last chunks) inside each sequence.
  check_against_finite_differences(Form::chunked, {{9, 4, 1}, 2, 4, 3, 5}, 4, seed += 10);
}

// Compares chunked with recurrent for every output and gradient, in scalar type S.
template <typename S>
void check_chunked_matches_recurrent(const Dims& dims, bool with_state, double tolerance,
                                     uint64_t seed, double g_min = -0.4) {
  const Problem<S> p = cast_problem<S>(make_problem(dims, with_state, with_state, seed, g_min));
  std::printf("chunked vs recurrent (%s) %s, initial/final state %s, g in [%g, 0]\n",
              sizeof(S) == 4 ? "fp32" : "fp64", describe(dims).c_str(), with_state ? "yes" : "no",
              g_min);
  const Outputs<S> rec = run_forward(Form::recurrent, p), chk = run_forward(Form::chunked, p);
  EXPECT_LT(compare("o", chk.o, rec.o).max_rel, tolerance);
  EXPECT_LT(compare("final_state", chk.final_state, rec.final_state).max_rel, tolerance);
  const Grads<S> grec = run_backward(Form::recurrent, p), gchk = run_backward(Form::chunked, p);
  EXPECT_LT(compare("dq", gchk.dq, grec.dq).max_rel, tolerance);
  EXPECT_LT(compare("dk", gchk.dk, grec.dk).max_rel, tolerance);
  EXPECT_LT(compare("dv", gchk.dv, grec.dv).max_rel, tolerance);
  EXPECT_LT(compare("dg", gchk.dg, grec.dg).max_rel, tolerance);
  EXPECT_LT(compare("dbeta", gchk.dbeta, grec.dbeta).max_rel, tolerance);
  EXPECT_LT(compare("d_initial_state", gchk.d_initial_state, grec.d_initial_state).max_rel,
            tolerance);
}

TEST(GatedDeltaRuleRef, ChunkedMatchesRecurrentFp32) {
  // 200 tokens = three full chunks and a partial one in one sequence, plus short sequences.
  check_chunked_matches_recurrent<float>({{200, 1, 64, 65}, 2, 4, 16, 8}, true, 1e-5, 300);
  check_chunked_matches_recurrent<float>({{200, 1, 64, 65}, 2, 4, 16, 8}, false, 1e-5, 310);
  check_chunked_matches_recurrent<float>({{257}, 1, 1, 32, 32}, true, 1e-5, 320);
  // Strong decay: exp(gamma) underflows within a chunk; the chunked form must stay finite.
  check_chunked_matches_recurrent<float>({{150, 20}, 1, 2, 16, 16}, true, 1e-5, 340, -30.0);
}

TEST(GatedDeltaRuleRef, ChunkedMatchesRecurrentFp64) {
  check_chunked_matches_recurrent<double>({{200, 1, 64, 65}, 2, 4, 16, 8}, true, 1e-12, 330);
}

// Runs each sequence alone (its own initial state, cu_seqlens {0, len}) and compares with the
// packed run: nothing may flow across sequence boundaries.
template <typename S>
void check_packed_matches_unpacked(Form form) {
  const Dims dims = {{1, 63, 64, 65, 130}, 1, 2, 8, 4};
  const Problem<S> packed = cast_problem<S>(make_problem(dims, true, true, 400));
  std::printf("packed vs unpacked, %s, %s\n", form_name(form), describe(dims).c_str());
  const Outputs<S> packed_out = run_forward(form, packed);
  const Grads<S> packed_grads = run_backward(form, packed);
  Outputs<S> joined;
  Grads<S> joined_grads;
  const int hv = dims.value_heads, hk = dims.key_heads, dk = dims.key_dim, dv = dims.value_dim;
  const int64_t state_numel = static_cast<int64_t>(hv) * dk * dv;
  auto append = [](std::vector<S>& to, const std::vector<S>& from, int64_t begin, int64_t count) {
    to.insert(to.end(), from.begin() + begin, from.begin() + begin + count);
  };
  for (size_t n = 0; n < dims.lengths.size(); ++n) {
    const int64_t t0 = packed.cu_seqlens[n], len = dims.lengths[n];
    Problem<S> single;
    single.dims = {{dims.lengths[n]}, hk, hv, dk, dv};
    single.cu_seqlens = {0, static_cast<int32_t>(len)};
    single.tokens = len;
    single.scale = packed.scale;
    append(single.q, packed.q, t0 * hk * dk, len * hk * dk);
    append(single.k, packed.k, t0 * hk * dk, len * hk * dk);
    append(single.v, packed.v, t0 * hv * dv, len * hv * dv);
    append(single.g, packed.g, t0 * hv, len * hv);
    append(single.beta, packed.beta, t0 * hv, len * hv);
    append(single.initial_state, packed.initial_state, n * state_numel, state_numel);
    append(single.d_o, packed.d_o, t0 * hv * dv, len * hv * dv);
    append(single.d_final_state, packed.d_final_state, n * state_numel, state_numel);
    const Outputs<S> out = run_forward(form, single);
    const Grads<S> gr = run_backward(form, single);
    append(joined.o, out.o, 0, out.o.size());
    append(joined.final_state, out.final_state, 0, out.final_state.size());
    append(joined_grads.dq, gr.dq, 0, gr.dq.size());
    append(joined_grads.dk, gr.dk, 0, gr.dk.size());
    append(joined_grads.dv, gr.dv, 0, gr.dv.size());
    append(joined_grads.dg, gr.dg, 0, gr.dg.size());
    append(joined_grads.dbeta, gr.dbeta, 0, gr.dbeta.size());
    append(joined_grads.d_initial_state, gr.d_initial_state, 0, gr.d_initial_state.size());
  }
  constexpr double kTolerance = 1e-5;
  EXPECT_LT(compare("o", packed_out.o, joined.o).max_rel, kTolerance);
  EXPECT_LT(compare("final_state", packed_out.final_state, joined.final_state).max_rel, kTolerance);
  EXPECT_LT(compare("dq", packed_grads.dq, joined_grads.dq).max_rel, kTolerance);
  EXPECT_LT(compare("dk", packed_grads.dk, joined_grads.dk).max_rel, kTolerance);
  EXPECT_LT(compare("dv", packed_grads.dv, joined_grads.dv).max_rel, kTolerance);
  EXPECT_LT(compare("dg", packed_grads.dg, joined_grads.dg).max_rel, kTolerance);
  EXPECT_LT(compare("dbeta", packed_grads.dbeta, joined_grads.dbeta).max_rel, kTolerance);
  EXPECT_LT(compare("d_initial_state", packed_grads.d_initial_state, joined_grads.d_initial_state)
                .max_rel,
            kTolerance);
}

TEST(GatedDeltaRuleRef, PackedMatchesUnpacked) {
  check_packed_matches_unpacked<float>(Form::recurrent);
  check_packed_matches_unpacked<float>(Form::chunked);
}

TEST(GatedDeltaRuleRef, PackingChangesResultsWhenBoundariesAreIgnored) {
  // Guard against a vacuous packing test: the same tokens as one sequence give other outputs.
  const Problem<float> two =
      cast_problem<float>(make_problem({{5, 6}, 1, 1, 4, 4}, false, false, 500));
  Problem<float> one = two;
  one.dims.lengths = {11};
  one.cu_seqlens = {0, 11};
  const auto out_two = run_forward(Form::chunked, two), out_one = run_forward(Form::chunked, one);
  EXPECT_GT(compare("o (one vs two sequences)", out_one.o, out_two.o).max_abs, 1e-3);
}

TEST(GatedDeltaRuleRef, EmptySequencePassesStateThrough) {
  // cu_seqlens {0, 3, 3, 5}: sequence 1 has no tokens, so its final state is its initial state
  // and its initial-state gradient is its final-state gradient.
  const Problem<double> p = make_problem({{3, 0, 2}, 1, 2, 4, 3}, true, true, 700);
  const int64_t per_seq = 2 * 4 * 3;
  auto slice = [&](const std::vector<double>& x) {
    return std::vector<double>(x.begin() + per_seq, x.begin() + 2 * per_seq);
  };
  for (Form form : {Form::recurrent, Form::chunked}) {
    std::printf("empty sequence, %s\n", form_name(form));
    const Outputs<double> out = run_forward(form, p);
    const Grads<double> gr = run_backward(form, p);
    EXPECT_EQ(compare("final_state", slice(out.final_state), slice(p.initial_state)).max_abs, 0.0);
    EXPECT_EQ(compare("d_initial_state", slice(gr.d_initial_state), slice(p.d_final_state)).max_abs,
              0.0);
  }
}

TEST(GatedDeltaRuleRef, RejectsBadArguments) {
  Problem<float> p = cast_problem<float>(make_problem({{4}, 2, 3, 4, 4}, false, false, 600));
  // Hv = 3 is not a multiple of Hk = 2.
  EXPECT_THROW(run_forward(Form::recurrent, p), Error);
  EXPECT_THROW(run_forward(Form::chunked, p), Error);
  p = cast_problem<float>(make_problem({{4}, 1, 2, 4, 4}, false, false, 610));
  p.cu_seqlens = {0, 3};  // does not end at T = 4
  EXPECT_THROW(run_forward(Form::chunked, p), Error);
  EXPECT_THROW(run_backward(Form::recurrent, p), Error);
  p.cu_seqlens = {0, 4};
  EXPECT_THROW(run_forward(Form::chunked, p, /*chunk_size=*/0), Error);
}

}  // namespace
}  // namespace deltamoe
