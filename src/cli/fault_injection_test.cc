// The hostile-user replay through the `deltamoe` binary: every input that once crashed,
// hung, was silently accepted or lost data now ends in a clear message (or a counted skip), fast.
// Each run is bounded by `timeout`, so a hang fails the test instead of stalling CI.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "checkpoint/model_checkpoint.h"
#include "model/config.h"
#include "data/image_test_util.h"
#include "testing/run_command.h"
#include "train/run_lock.h"
#include "train/train_test_util.h"

namespace deltamoe {
namespace {

using namespace train_test;

struct Result {
  int exit_code;  // -signal when killed; 137 also when `timeout` had to kill it
  std::string output;
  double seconds;
};

class FaultInjectionTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new fs::path(fresh_temp_dir("fault_injection"));
    make_tiny_vl_fixture(*root_, 8, 4);
  }
  static void TearDownTestSuite() {
    fs::remove_all(*root_);
    delete root_;
  }

  static std::string binary() { return deltamoe_binary(); }
  // `deltamoe train FLAGS`, killed after `limit_s` seconds (then exit code 137).
  static Result train(const std::string& flags, int limit_s = 120, const std::string& env = "") {
    const fs::path log = *root_ / "run.log";
    const auto start = std::chrono::steady_clock::now();
    const int status = std::system(str_cat(env, " timeout -s KILL ", limit_s, " ", binary(), " train ", flags, " > ",
                                           log.string(), " 2>&1")
                                       .c_str());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status), read_bytes(log), seconds};
  }
  static std::string model() { return (*root_ / "tiny-vl").string(); }
  static std::string data() { return (*root_ / "data" / "train.jsonl").string(); }
  // A short valid run; `extra` adds or overrides flags.
  static std::string flags(const std::string& model_dir, const std::string& dataset, const fs::path& out,
                           const std::string& extra = "") {
    return str_cat("--model ", model_dir, " --dataset ", dataset, " --output_dir ", out.string(),
                   " --max_length 128 --micro_batch_tokens 256 --min_pixels 4096 --max_pixels 4096 --lr 1e-3 ", extra);
  }
  // A copy of the tiny-vl model directory whose files `edit` may change.
  static std::string model_copy(const std::string& name) {
    const fs::path dir = *root_ / name;
    fs::remove_all(dir);
    fs::copy(*root_ / "tiny-vl", dir, fs::copy_options::recursive);
    return dir.string();
  }
  static fs::path* root_;
};
fs::path* FaultInjectionTest::root_ = nullptr;

void expect_contains(const Result& result, const std::string& text, const std::string& what) {
  EXPECT_NE(result.output.find(text), std::string::npos) << what << ": expected '" << text << "' in:\n"
                                                          << result.output;
}

int64_t newest_checkpoint_step(const fs::path& out) {
  int64_t step = -1;
  if (!fs::is_directory(out)) return step;
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with("checkpoint-")) step = std::max<int64_t>(step, std::stoll(name.substr(11)));
  }
  return step;
}

// Flags whose values were taken as they came: each is refused before any work, naming the flag and
// the allowed range. (Before: abort, OOM, NaN weights saved with exit 0, or a misleading message.)
TEST_F(FaultInjectionTest, AbsurdNumbersAndMisplacedFlagsAreRefusedUpFront) {
  const fs::path out = *root_ / "flags_out";
  struct Case {
    std::string extra;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"--dataloader_num_workers 100000", "--dataloader_num_workers must be in [0, 256], got 100000"},
      {"--gradient_accumulation_steps 1000000000000", "--gradient_accumulation_steps must be in [0, 65536]"},
      {"--max_length 1000000000000", "--max_length must be in [1, 16777216]"},
      {"--micro_batch_tokens 1000000000000", "--micro_batch_tokens must be in [0, 16777216]"},
      {"--lr 1e10", "--lr must be in (0, 1]"},
      {"--lr nan", "--lr must be a finite number, got 'nan'"},
      {"--max_grad_norm nan", "--max_grad_norm must be a finite number, got 'nan'"},
      {"--max_grad_norm inf", "--max_grad_norm must be a finite number, got 'inf'"},
      {"--adam_beta1 nan", "--adam_beta1 must be a finite number"},
      {"--num_train_epochs 1000000000000", "--num_train_epochs must be in [1, 1000000]"},
      {"--max_decoded_pixels 0", "--max_decoded_pixels must be in [1, 1073741824]"},
      {"--max_nonfinite_steps -1", "--max_nonfinite_steps must be >= 0"},
      {"--lr --max_steps 2", "flag --lr needs a value, but the next argument is the flag --max_steps"},
  };
  for (const Case& c : cases) {
    const Result result = train(flags(model(), data(), out, c.extra), 60);
    EXPECT_EQ(result.exit_code, 1) << c.extra << "\n" << result.output;
    expect_contains(result, c.message, c.extra);
    EXPECT_EQ(result.output.find("step 1/"), std::string::npos) << "training started for " << c.extra;
  }
  // A directory or a device as --dataset: said as it is, not "no such file".
  const Result directory = train(flags(model(), (*root_ / "data").string(), out), 60);
  EXPECT_EQ(directory.exit_code, 1);
  expect_contains(directory, "is a directory; give JSONL files", "--dataset DIR");
  const Result device = train(flags(model(), "/dev/null", out), 60);
  EXPECT_EQ(device.exit_code, 1);
  expect_contains(device, "'/dev/null' is not a regular file", "--dataset /dev/null");
}

// One dataset with every hostile line of the issue among good ones: JSON nested 100,000 deep (in
// content, tools and tool-call arguments), a directory, /dev/zero, /dev/urandom, /proc/self/mem and
// a FIFO as images, decompression bombs. The run trains on the good lines, counts the rest as
// skips, and a resume passes over the same lines again. (Before: stack overflow, a FIFO that
// blocks forever, reads of endless devices, gigabytes decoded for one image.)
TEST_F(FaultInjectionTest, HostileLinesAreSkippedAndTheRunAndItsResumeFinish) {
  const fs::path dir = *root_ / "data";
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::string user = R"({"role": "user", "content": "Hi"})";
  const std::string answer = R"({"role": "assistant", "content": "Hello there."})";
  auto image_line = [&](const std::string& path) {
    return str_cat(R"({"messages": [{"role": "user", "content": [{"type": "image", "image": ")", path,
                   R"("}, {"type": "text", "text": "What is it?"}]}, )", answer, "]}");
  };
  ASSERT_EQ(::mkfifo((*root_ / "fifo.png").c_str(), 0644), 0);
  // A 20000x20000 PNG of zeros: 1-bit grey compresses 50 MB of rows to ~50 KB.
  const int side = 20000;
  {
    const std::vector<uint8_t> rows(static_cast<size_t>(side) * ((side + 7) / 8), 0);
    const std::vector<uint8_t> png = image_test::encode_png(rows, side, side, PNG_COLOR_TYPE_GRAY, 1);
    std::ofstream(*root_ / "bomb.png", std::ios::binary).write(reinterpret_cast<const char*>(png.data()), png.size());
  }
  {  // A small JPEG whose header claims 30000x30000.
    std::vector<uint8_t> jpeg = image_test::encode_jpeg(image_test::gradient_image(16, 16), 90);
    for (size_t i = 0; i + 8 < jpeg.size(); ++i) {
      if (jpeg[i] == 0xFF && jpeg[i + 1] == 0xC0) {
        jpeg[i + 5] = 30000 >> 8, jpeg[i + 6] = 30000 & 0xFF, jpeg[i + 7] = 30000 >> 8, jpeg[i + 8] = 30000 & 0xFF;
        break;
      }
    }
    std::ofstream(*root_ / "bomb.jpg", std::ios::binary).write(reinterpret_cast<const char*>(jpeg.data()), jpeg.size());
  }
  std::string text = read_bytes(dir / "train.jsonl");
  const std::vector<std::string> hostile = {
      R"({"messages": [{"role": "user", "content": [)" + deep + "]}, " + answer + "]}",
      R"({"messages": [)" + user + ", " + answer + R"(], "tools": )" + deep + "}",
      R"({"messages": [)" + user + ", " + answer + R"(], "tools": ")" + deep + "\"}",
      R"({"messages": [)" + user + R"(, {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"a": )" +
          deep + "}}]}]}",
      image_line(dir.string()),
      image_line("/dev/zero"),
      image_line("/dev/urandom"),
      image_line("/proc/self/mem"),
      image_line((*root_ / "fifo.png").string()),
      image_line((*root_ / "bomb.png").string()),
      image_line((*root_ / "bomb.jpg").string()),
  };
  for (const std::string& line : hostile) text += line + "\n";
  const fs::path dataset = dir / "hostile.jsonl";
  std::ofstream(dataset, std::ios::binary) << text;

  // Epochs, not --max_steps: every line is read (the step count comes from a full pass first).
  const fs::path out = *root_ / "hostile_out";
  // --max_skip_ratio 1: 11 of the lines are hostile on purpose, far over the default 5% that stops a run.
  const std::string run_flags =
      flags(model(), dataset.string(), out, "--num_train_epochs 2 --dataloader_num_workers 2 --max_skip_ratio 1");
  const Result first = train(run_flags + " --stop_after_steps 2");
  std::printf("  first run: %.1f s, exit %d\n%s", first.seconds, first.exit_code, first.output.c_str());
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const Result resumed = train(run_flags + " --resume auto");
  std::printf("  resumed run: %.1f s, exit %d\n", resumed.seconds, resumed.exit_code);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  // The summary counts the skips of the resumed run's pass over both epochs' remaining lines; the
  // pass that counted the steps saw each hostile line once.
  expect_contains(first, "11 skipped (malformed_json 4, bad_image 7)", "the step-counting pass");
  expect_contains(resumed, "malformed_json", "the resumed run");
  EXPECT_GT(newest_checkpoint_step(out), 2);
}

// Every line skipped with --max_steps: the data repeats forever, so the first empty pass is an
// error at once. (Before: 100% CPU forever, deaf to SIGTERM.)
TEST_F(FaultInjectionTest, AllSamplesSkippedIsAnErrorNotAnEndlessLoop) {
  const fs::path dataset = *root_ / "all_bad.jsonl";
  std::ofstream(dataset) << "not json\n{\"messages\": []}\n[1, 2]\n";
  const Result result = train(flags(model(), dataset.string(), *root_ / "all_bad_out", "--max_steps 5"), 60);
  std::printf("  %.1f s, exit %d\n", result.seconds, result.exit_code);
  EXPECT_EQ(result.exit_code, 1) << result.output;
  expect_contains(result, "was skipped in epoch 0", "all skipped");
  expect_contains(result, "malformed_json 2", "all skipped");
}

// A NaN in the weights is refused at load, naming the tensor. (Before: every step skipped, a
// checkpoint saved, exit 0.)
TEST_F(FaultInjectionTest, NanWeightsAreRefusedAtLoadNamingTheTensor) {
  const std::string dir = model_copy("nan_model");
  ModelCheckpoint checkpoint = load_model_dir(model());
  const std::string name = checkpoint.params.begin()->first;
  HostTensor values = checkpoint.params.at(name).to_host().to_f32();
  static_cast<float*>(values.data())[values.numel() / 2] = std::numeric_limits<float>::quiet_NaN();
  checkpoint.params[name] = StoredTensor::from_host(values.to_dtype(checkpoint.params.at(name).dtype()));
  save_model_dir(checkpoint, dir);
  const fs::path out = *root_ / "nan_out";
  const Result result = train(flags(dir, data(), out, "--max_steps 2"), 60);
  EXPECT_EQ(result.exit_code, 1) << result.output;
  expect_contains(result, str_cat("tensor '", name, "'"), "the NaN tensor");
  expect_contains(result, "holds NaN or Inf", "the NaN tensor");
  EXPECT_EQ(newest_checkpoint_step(out), -1) << "a checkpoint was written";
}

// Finite weights that overflow in the forward pass (a diverged model) give a NaN loss every step:
// the run stops after --max_nonfinite_steps of them with an error and writes no checkpoint over
// the last good one. (Before: every step skipped, the broken weights saved, exit 0.)
TEST_F(FaultInjectionTest, ADivergedRunStopsWithoutSaving) {
  const std::string dir = model_copy("diverged_model");
  ModelCheckpoint checkpoint = load_model_dir(model());
  std::string name;
  for (const auto& [key, tensor] : checkpoint.params) {
    if (key.ends_with("lm_head.weight")) name = key;
  }
  ASSERT_FALSE(name.empty());
  HostTensor values = checkpoint.params.at(name).to_host().to_f32();
  for (int64_t i = 0; i < values.numel(); ++i) static_cast<float*>(values.data())[i] = (i % 2 ? 3e38f : -3e38f);
  checkpoint.params[name] = StoredTensor::from_host(values.to_dtype(checkpoint.params.at(name).dtype()));
  save_model_dir(checkpoint, dir);
  const fs::path out = *root_ / "diverged_out";
  const Result result = train(flags(dir, data(), out, "--max_steps 8 --save_steps 1"), 60);  // default limit: 5
  EXPECT_EQ(result.exit_code, 1) << result.output;
  expect_contains(result, "training diverged: steps 1..5 (5 in a row, --max_nonfinite_steps 5)", "the divergence stop");
  EXPECT_EQ(newest_checkpoint_step(out), -1) << "a checkpoint of a diverged run was written";
}

// preprocessor_config.json is read by `train` as by `data` and checked before any sample: a zero
// std, min_pixels > max_pixels, and an image_token_id that is not the tokenizer's <|image_pad|>.
// (Before: std 0 accepted, every image skipped one by one, a failure at the first image batch.)
TEST_F(FaultInjectionTest, BadImageSettingsAreRefusedBeforeAnySample) {
  auto edit_json = [](const fs::path& path, const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json json;
    if (fs::exists(path)) {
      std::ifstream in(path);
      json = nlohmann::json::parse(in);
    } else {  // the fixture has none: start from what `deltamoe init` writes
      json = nlohmann::json::parse(
          preprocessor_config_json(load_model_config_file((path.parent_path() / "config.json").string())));
    }
    edit(json);
    std::ofstream(path) << json.dump(2);
  };
  struct Case {
    std::string name;
    std::string file;
    std::function<void(nlohmann::json&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"std0", "preprocessor_config.json", [](nlohmann::json& j) { j["image_std"] = {0.5, 0.0, 0.5}; },
       "image_std[1] is 0; it must be a positive finite number"},
      {"minmax", "preprocessor_config.json",
       [](nlohmann::json& j) { j["size"] = {{"shortest_edge", 1048576}, {"longest_edge", 65536}}; },
       "min_pixels (1048576) exceeds max_pixels (65536)"},
      {"token", "config.json", [](nlohmann::json& j) { j["image_token_id"] = j["image_token_id"].get<int64_t>() - 1; },
       "differs from the tokenizer's <|image_pad|> id"},
  };
  for (const Case& c : cases) {
    const std::string dir = model_copy("settings_" + c.name);
    edit_json(fs::path(dir) / c.file, c.edit);
    // No --min_pixels / --max_pixels here: the file's values are the ones checked.
    const Result result = train(str_cat("--model ", dir, " --dataset ", data(), " --output_dir ",
                                        (*root_ / ("settings_out_" + c.name)).string(),
                                        " --max_length 128 --micro_batch_tokens 256 --max_steps 2"),
                                60);
    EXPECT_EQ(result.exit_code, 1) << c.name << "\n" << result.output;
    expect_contains(result, c.message, c.name);
    EXPECT_EQ(result.output.find("step 1/"), std::string::npos) << c.name << ": training started";
  }
  // The file's size limits are used: 128x128 images from the file give the same first step as the
  // same limits given as flags (with the defaults, 256x256 images, the tokens would differ).
  const std::string dir = model_copy("settings_small");
  edit_json(fs::path(dir) / "preprocessor_config.json",
            [](nlohmann::json& j) { j["size"] = {{"shortest_edge", 16384}, {"longest_edge", 16384}}; });
  auto first_step_tokens = [&](const std::string& model_dir, const std::string& name, const std::string& extra) {
    const fs::path out = *root_ / name;
    const Result result = train(str_cat("--model ", model_dir, " --dataset ", data(), " --output_dir ", out.string(),
                                        " --max_length 256 --micro_batch_tokens 512 --max_steps 1 ", extra),
                                60);
    EXPECT_EQ(result.exit_code, 0) << result.output;
    std::ifstream in(out / "metrics.jsonl");
    std::string line;
    std::getline(in, line);
    return nlohmann::json::accept(line) ? nlohmann::json::parse(line).value("tokens", int64_t{-1}) : int64_t{-1};
  };
  const int64_t from_file = first_step_tokens(dir, "settings_file_out", "");
  const int64_t from_flags = first_step_tokens(model(), "settings_flags_out", "--min_pixels 16384 --max_pixels 16384");
  std::printf("  first step: %lld tokens (file), %lld (flags)\n", static_cast<long long>(from_file),
              static_cast<long long>(from_flags));
  EXPECT_GT(from_flags, 0);
  EXPECT_EQ(from_file, from_flags);
}

// Runs a command in the background (its pid), logging to `log`.
pid_t spawn(const std::string& command, const fs::path& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string shell = str_cat("exec ", command, " > ", log.string(), " 2>&1");
    execl("/bin/sh", "sh", "-c", shell.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

bool wait_for_text(const fs::path& log, const std::string& text, int limit_s) {
  for (int i = 0; i < limit_s * 10; ++i) {
    if (read_bytes(log).find(text) != std::string::npos) return true;
    usleep(100000);
  }
  return false;
}

// Waits up to limit_s for pid; SIGKILLs it after that. Returns the wait status (-1: had to kill).
int wait_or_kill(pid_t pid, int limit_s) {
  int status = 0;
  for (int i = 0; i < limit_s * 10; ++i) {
    if (waitpid(pid, &status, WNOHANG) == pid) return status;
    usleep(100000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &status, 0);
  return -1;
}

// A second run into a folder in use fails at once instead of replacing the first one's checkpoints
// and tearing its metrics; the first run goes on undisturbed. (Before: both exit 0, data lost.)
TEST_F(FaultInjectionTest, ASecondRunIntoTheSameFolderIsRefused) {
  const fs::path out = *root_ / "shared_out";
  const fs::path log = *root_ / "first.log";
  const pid_t first = spawn(str_cat(binary(), " train ", flags(model(), data(), out, "--max_steps 500")), log);
  ASSERT_GT(first, 0);
  const bool started = wait_for_text(log, "step 1/500", 120);
  const Result second = train(flags(model(), data(), out, "--max_steps 500"), 60);
  kill(first, SIGTERM);
  const int status = wait_or_kill(first, 60);
  ASSERT_TRUE(started) << read_bytes(log);
  EXPECT_EQ(second.exit_code, 1) << second.output;
  expect_contains(second, "is in use by another training run (pid ", "second run");
  ASSERT_TRUE(WIFEXITED(status)) << read_bytes(log);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << read_bytes(log);
  std::ifstream metrics(out / "metrics.jsonl");
  int64_t lines = 0;
  for (std::string line; std::getline(metrics, line); ++lines) {
    EXPECT_TRUE(nlohmann::json::accept(line)) << "torn metrics line: " << line;
  }
  EXPECT_GT(lines, 0);
}

// A fresh run into a folder that holds an earlier run is refused (its metrics kept byte for byte)
// unless --overwrite_output_dir: the earlier run's metrics history is not wiped and its checkpoints are
// not mixed with the new run's.
TEST_F(FaultInjectionTest, AFreshRunDoesNotWipeAnEarlierRun) {
  const fs::path out = *root_ / "used_out";
  const Result earlier = train(flags(model(), data(), out, "--max_steps 4 --save_steps 2"));
  ASSERT_EQ(earlier.exit_code, 0) << earlier.output;
  const std::string history = read_bytes(out / "metrics.jsonl");
  const Result fresh = train(flags(model(), data(), out, "--max_steps 2"));
  EXPECT_EQ(fresh.exit_code, 1) << fresh.output;
  expect_contains(fresh, "holds an earlier run (", "fresh run");
  expect_contains(fresh, "--resume auto", "fresh run");
  EXPECT_EQ(read_bytes(out / "metrics.jsonl"), history);
  EXPECT_TRUE(fs::exists(out / "checkpoint-4"));
  const Result overwrite = train(flags(model(), data(), out, "--max_steps 2 --overwrite_output_dir true"));
  EXPECT_EQ(overwrite.exit_code, 0) << overwrite.output;
  EXPECT_FALSE(fs::exists(out / "checkpoint-4")) << "the earlier run's checkpoint would confuse --resume auto";
  EXPECT_TRUE(fs::exists(out / "checkpoint-2"));
}

// SIGHUP (a closed terminal or ssh session) is a graceful stop like SIGTERM: the step finishes, a
// checkpoint is saved, and --resume auto continues. (Before: the process died, progress lost.)
TEST_F(FaultInjectionTest, SighupSavesLikeSigterm) {
  const fs::path out = *root_ / "sighup_out";
  const fs::path log = *root_ / "sighup.log";
  const std::string run_flags = flags(model(), data(), out, "--max_steps 500");
  const pid_t pid = spawn(str_cat(binary(), " train ", run_flags), log);
  const bool started = wait_for_text(log, "step 1/500", 120);
  kill(pid, SIGHUP);
  const int status = wait_or_kill(pid, 60);
  ASSERT_TRUE(started) << read_bytes(log);
  ASSERT_TRUE(status != -1 && WIFEXITED(status)) << "SIGHUP ended the process abruptly:\n" << read_bytes(log);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGHUP) << read_bytes(log);
  const int64_t saved = newest_checkpoint_step(out);
  ASSERT_GE(saved, 1) << read_bytes(log);
  const Result resumed = train(str_cat(run_flags, " --resume auto --stop_after_steps 1"));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(newest_checkpoint_step(out), saved + 1);
}

// SIGTERM while a huge global batch is still being read (65,536 micro-batches) stops the run at
// once. (Before: the accumulation loop ignored the stop flag until memory ran out.)
TEST_F(FaultInjectionTest, SigtermDuringALongAccumulationStopsPromptly) {
  const fs::path out = *root_ / "accumulation_out";
  const fs::path log = *root_ / "accumulation.log";
  const pid_t pid =
      spawn(str_cat(binary(), " train ", flags(model(), data(), out, "--max_steps 2 --gradient_accumulation_steps 65536")),
            log);
  const bool started = wait_for_text(log, "train: global batch 65536", 120);
  sleep(2);  // well inside the accumulation loop (the tiny model loads in milliseconds)
  const auto signalled = std::chrono::steady_clock::now();
  kill(pid, SIGTERM);
  const int status = wait_or_kill(pid, 20);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count();
  ASSERT_TRUE(started) << read_bytes(log);
  ASSERT_NE(status, -1) << "still running 20 s after SIGTERM:\n" << read_bytes(log);
  std::printf("  stopped %.2f s after SIGTERM\n", seconds);
  ASSERT_TRUE(WIFEXITED(status)) << read_bytes(log);
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM) << read_bytes(log);
  EXPECT_EQ(newest_checkpoint_step(out), -1) << "no step was finished, so there is nothing to save";
}

}  // namespace
}  // namespace deltamoe
