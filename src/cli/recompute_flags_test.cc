// The recompute flags: Megatron's names and the one-word --recompute give the same options;
// conflicting or meaningless combinations are refused naming the flags.
#include "cli/recompute_flags.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "core/error.h"

namespace deltamoe {
namespace {

RecomputeOptions parse_flags(std::vector<const char*> args, const char* default_choice = "auto") {
  ArgParser parser("train", "test");
  declare_recompute_flags(parser, default_choice);
  args.insert(args.begin(), {"deltamoe", "train"});
  EXPECT_TRUE(parser.parse(static_cast<int>(args.size()), const_cast<char**>(args.data())));
  return parse_recompute_flags(parser);
}

std::string refusal(std::vector<const char*> args) {
  try {
    parse_flags(std::move(args));
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(RecomputeFlags, DefaultIsTheCommandsChoice) {
  const RecomputeOptions train = parse_flags({});
  EXPECT_TRUE(train.automatic);
  EXPECT_FALSE(train.mixers);
  EXPECT_EQ(train.layers, 0);
  const RecomputeOptions bench = parse_flags({}, "none");
  EXPECT_FALSE(bench.automatic);
  EXPECT_FALSE(bench.mixers);
  EXPECT_EQ(bench.layers, 0);
}

TEST(RecomputeFlags, MegatronNamesAndTheOneWordFormAgree) {
  EXPECT_TRUE(parse_flags({"--recompute", "selective"}).mixers);
  EXPECT_TRUE(parse_flags({"--recompute_granularity", "selective"}).mixers);
  EXPECT_FALSE(parse_flags({"--recompute_granularity", "selective"}).automatic);
  EXPECT_EQ(parse_flags({"--recompute", "full"}).layers, kRecomputeAllLayers);
  EXPECT_EQ(parse_flags({"--recompute_granularity", "full"}).layers, kRecomputeAllLayers);
  EXPECT_EQ(parse_flags({"--recompute_granularity", "full", "--recompute_num_layers", "35"}).layers, 35);
  EXPECT_EQ(parse_flags({"--recompute_granularity", "full", "--recompute_method", "block", "--recompute_num_layers",
                         "3"}).layers, 3);
  // Megatron's usual "every layer" setting.
  EXPECT_EQ(parse_flags({"--recompute_granularity", "full", "--recompute_method", "uniform", "--recompute_num_layers",
                         "1"}).layers, kRecomputeAllLayers);
  EXPECT_EQ(parse_flags({"--recompute", "full", "--recompute_granularity", "full"}).layers, kRecomputeAllLayers);
  // Full recompute also reruns every vision block; the other choices keep them.
  EXPECT_EQ(parse_flags({"--recompute", "full", "--recompute_num_layers", "3"}).vision_blocks, kRecomputeAllLayers);
  EXPECT_EQ(parse_flags({"--recompute_granularity", "full"}).vision_blocks, kRecomputeAllLayers);
  for (const char* choice : {"none", "selective", "auto"})
    EXPECT_EQ(parse_flags({"--recompute", choice}).vision_blocks, 0) << choice;
  EXPECT_EQ(RecomputeOptions{.vision_blocks = kRecomputeAllLayers}.full_vision_blocks(27), 27);
  EXPECT_EQ(RecomputeOptions{.vision_blocks = 5}.full_vision_blocks(27), 5);
  EXPECT_EQ(RecomputeOptions{.layers = kRecomputeAllLayers}.full_layers(40), 40);
  EXPECT_EQ(RecomputeOptions{.layers = 7}.full_layers(40), 7);
}

TEST(RecomputeFlags, RefusesWhatItCannotDo) {
  EXPECT_NE(refusal({"--recompute", "selective", "--recompute_granularity", "full"}).find("disagree"),
            std::string::npos);
  EXPECT_NE(refusal({"--recompute_num_layers", "4"}).find("needs full recompute"), std::string::npos);
  EXPECT_NE(refusal({"--recompute", "selective", "--recompute_method", "block"}).find("needs full recompute"),
            std::string::npos);
  EXPECT_NE(refusal({"--recompute_granularity", "full", "--recompute_method", "uniform", "--recompute_num_layers", "2"})
                .find("uniform is supported with --recompute_num_layers 1"),
            std::string::npos);
  EXPECT_NE(refusal({"--recompute_granularity", "full", "--recompute_num_layers", "-2"}).find("must be positive"),
            std::string::npos);
  EXPECT_NE(refusal({"--recompute_granularity", "everything"}).find("selective or full"), std::string::npos);
  EXPECT_NE(refusal({"--recompute", "some"}).find("not a recompute choice"), std::string::npos);
}

}  // namespace
}  // namespace deltamoe
