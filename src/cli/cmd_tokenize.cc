// `deltamoe tokenize`: one {"text": ...} JSON object per input line -> one {"ids": [...]} per
// output line, in the same order; prints the tokenizer's throughput on stderr.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "cli/args.h"
#include "cli/commands.h"
#include "core/error.h"
#include "core/log.h"
#include "tokenizer/tokenizer.h"

namespace deltamoe {
namespace {

constexpr size_t kBatchLines = 8192;

std::string text_of_line(const std::string& line, const std::string& path, size_t line_number) {
  nlohmann::json object;
  try {
    object = nlohmann::json::parse(line);
  } catch (const nlohmann::json::exception& error) {
    RAISE(path, ":", line_number, ": not a JSON object: ", error.what());
  }
  CHECK(object.is_object() && object.contains("text") && object["text"].is_string(), path, ":", line_number,
        ": expected {\"text\": \"...\"}");
  return object["text"].get<std::string>();
}

void append_ids_line(const std::vector<int32_t>& ids, std::string& out) {
  out += "{\"ids\": [";
  for (size_t i = 0; i < ids.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(ids[i]);
  }
  out += "]}\n";
}

}  // namespace

int cmd_tokenize(int argc, char** argv) {
  ArgParser args("tokenize", "turn {\"text\": ...} JSONL lines into {\"ids\": [...]} lines");
  args.add_required("tokenizer", "a tokenizer.json, or a model directory holding one");
  args.add_required("in", "input JSONL, one {\"text\": ...} per line");
  args.add_required("out", "output JSONL, one {\"ids\": [...]} per line, same order");
  args.add_option("threads", "encoding threads", "1");
  if (!args.parse(argc, argv)) return 0;
  const int64_t num_threads = args.get_int("threads");
  CHECK(num_threads >= 1 && num_threads <= 1024, "--threads must be in 1..1024, got ", num_threads);

  const Tokenizer tokenizer = Tokenizer::load(args.get("tokenizer"));
  const std::string in_path = args.get("in"), out_path = args.get("out");
  std::ifstream in(in_path, std::ios::binary);
  CHECK(in.good(), "cannot open --in '", in_path, "'");
  std::FILE* out = std::fopen(out_path.c_str(), "wb");
  CHECK(out != nullptr, "cannot create --out '", out_path, "'");

  size_t line_number = 0, num_bytes = 0;
  double encode_seconds = 0;
  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids;
  std::string line, buffer;
  bool done = false;
  try {
    while (!done) {
      texts.clear();
      while (texts.size() < kBatchLines) {
        if (!std::getline(in, line)) {
          done = true;
          break;
        }
        ++line_number;
        texts.push_back(text_of_line(line, in_path, line_number));
        num_bytes += texts.back().size();
      }
      ids.assign(texts.size(), {});
      const auto start = std::chrono::steady_clock::now();
      const size_t first_line = line_number - texts.size() + 1;
      const auto encode_range = [&](size_t worker) {
        for (size_t i = worker; i < texts.size(); i += static_cast<size_t>(num_threads)) {
          try {
            ids[i] = tokenizer.encode(texts[i]);
          } catch (const Error& error) {
            RAISE(in_path, ":", first_line + i, ": ", error.what());
          }
        }
      };
      if (num_threads == 1) {
        encode_range(0);
      } else {
        std::vector<std::thread> workers;
        std::vector<std::string> failures(static_cast<size_t>(num_threads));
        for (int64_t w = 0; w < num_threads; ++w) {
          workers.emplace_back([&, w] {
            try {
              encode_range(static_cast<size_t>(w));
            } catch (const Error& error) {
              failures[static_cast<size_t>(w)] = error.what();
            }
          });
        }
        for (auto& worker : workers) worker.join();
        for (const auto& failure : failures) CHECK(failure.empty(), failure);
      }
      encode_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      buffer.clear();
      for (const auto& line_ids : ids) append_ids_line(line_ids, buffer);
      CHECK(std::fwrite(buffer.data(), 1, buffer.size(), out) == buffer.size(), "cannot write --out '", out_path, "'");
    }
  } catch (...) {
    std::fclose(out);
    throw;
  }
  CHECK(std::fclose(out) == 0, "cannot write --out '", out_path, "'");
  log_info("tokenized ", line_number, " lines, ", num_bytes, " bytes of text in ", encode_seconds, " s of encoding (",
           encode_seconds > 0 ? num_bytes / 1e6 / encode_seconds : 0.0, " MB/s, ", num_threads, " thread(s))");
  return 0;
}

}  // namespace deltamoe
