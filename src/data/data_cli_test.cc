// 'deltamoe data' through the built binary ($DELTAMOE_BINARY): the report on a dataset with good
// and bad lines (counts and reasons), the label-mask preview, and clear errors for bad flags/files.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>

#include "data/data_test_util.h"
#include "testing/run_deltamoe.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

// A model folder with only the tokenizer (image settings fall back to Qwen3.5's).
fs::path tokenizer_only_model(const fs::path& folder) {
  const fs::path model = folder / "model";
  fs::create_directories(model);
  fs::create_symlink(fs::absolute(data_test::kQwen3Tokenizer), model / "tokenizer.json");
  return model;
}

TEST(DataCli, ReportsCountsSkipsAndPreview) {
  const fs::path folder = data_test::temp_folder();
  data_test::write_bytes(folder / "data/cat.jpg", data_test::jpeg_bytes(64, 64));
  data_test::write_text(folder / "data/train.jsonl",
                        data_test::chat_line("Hi", "Hello there") +
                            R"({"messages": [{"role": "user", "content": "<image>What?"}, {"role": "assistant", "content": "A cat."}], "images": ["cat.jpg"]})"
                            "\n{broken\n" +
                            R"({"messages": [{"role": "user", "content": "<image>x"}, {"role": "assistant", "content": "y"}], "images": ["dog.jpg"]})"
                            "\n" + data_test::chat_line("Bye", "See you"));
  const fs::path model = tokenizer_only_model(folder);
  const CommandResult result =
      run_deltamoe("data --dataset " + (folder / "data/train.jsonl").string() + " --model " + model.string() +
                   " --max_length 256 --min_pixels 1024 --num_workers 1 --preview 1");
  std::printf("%s", result.output.c_str());
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_NE(result.output.find("3 kept, 2 skipped (malformed_json 1, missing_image 1)"), std::string::npos);
  EXPECT_NE(result.output.find("images:      1, 4 image tokens"), std::string::npos);
  EXPECT_NE(result.output.find("train.jsonl:3"), std::string::npos) << "the malformed line is named";
  EXPECT_NE(result.output.find("[[A cat.<|im_end|>]]"), std::string::npos) << "preview marks the supervised answer";
  EXPECT_NE(result.output.find("<|image_pad|> x 4"), std::string::npos);
  EXPECT_NE(result.output.find("image grid (t, h, w) = (1, 4, 4)"), std::string::npos);
}

TEST(DataCli, BadFlagsAndFilesAreClearErrors) {
  const fs::path folder = data_test::temp_folder();
  const fs::path model = tokenizer_only_model(folder);
  CommandResult result =
      run_deltamoe("data --dataset " + (folder / "none.jsonl").string() + " --model " + model.string());
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("none.jsonl"), std::string::npos) << result.output;
  data_test::write_text(folder / "one.jsonl", data_test::chat_line("q", "a"));
  result = run_deltamoe("data --dataset " + (folder / "one.jsonl").string() + " --model " + model.string() + " --truncation_strategy left");
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("--truncation_strategy"), std::string::npos) << result.output;
  result = run_deltamoe("data --dataset " + (folder / "one.jsonl").string() + " --model " + model.string() + " --preview 5");
  EXPECT_NE(result.exit_code, 0);
  EXPECT_NE(result.output.find("--preview 5 is out of range"), std::string::npos) << result.output;
  result = run_deltamoe("data --dataset " + (folder / "one.jsonl").string() + " --model " + model.string() +
                        " --max_length 1000000000000");
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("--max_length must be in [1, 16777216]"), std::string::npos) << result.output;
  result = run_deltamoe("data --dataset " + folder.string() + " --model " + model.string());
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.output.find("is a directory; give JSONL files"), std::string::npos) << result.output;
}

// `data` reads preprocessor_config.json through the loader `train` uses, so both refuse the same
// settings before any sample is read. (Before: a std of 0 was accepted and divided by.)
TEST(DataCli, ImageSettingsAreCheckedAsTrainChecksThem) {
  const fs::path folder = data_test::temp_folder();
  const fs::path model = tokenizer_only_model(folder);
  data_test::write_text(model / "preprocessor_config.json", R"({"image_std": [0.5, 0.0, 0.5]})");
  data_test::write_text(folder / "one.jsonl", data_test::chat_line("q", "a"));
  const CommandResult result =
      run_deltamoe("data --dataset " + (folder / "one.jsonl").string() + " --model " + model.string());
  EXPECT_EQ(result.exit_code, 1) << result.output;
  EXPECT_NE(result.output.find("image_std[1] is 0; it must be a positive finite number"), std::string::npos)
      << result.output;
  EXPECT_EQ(result.output.find("samples:"), std::string::npos) << "the data was read";
}

}  // namespace
}  // namespace deltamoe
