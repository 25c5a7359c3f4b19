// Progress line formatting and the metrics JSONL writer.
#include "train/train_metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/fs_sync.h"
#include "core/kill_point.h"

namespace deltamoe {

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const int64_t total = static_cast<int64_t>(std::llround(seconds));
  char text[32];
  if (total >= 3600) {
    std::snprintf(text, sizeof(text), "%lldh%02lldm", static_cast<long long>(total / 3600),
                  static_cast<long long>(total % 3600 / 60));
  } else if (total >= 60) {
    std::snprintf(text, sizeof(text), "%lldm%02llds", static_cast<long long>(total / 60),
                  static_cast<long long>(total % 60));
  } else {
    std::snprintf(text, sizeof(text), "%llds", static_cast<long long>(total));
  }
  return text;
}

double default_peak_tflops(const std::string& gpu_name) {
  auto has = [&](const char* part) { return gpu_name.find(part) != std::string::npos; };
  if (has("H100") && has("PCIe")) return 756.0;
  if (has("H100") || has("H200") || has("H800") || has("GH200")) return 989.0;
  if (has("A100") || has("A800")) return 312.0;
  if (has("L40S")) return 362.0;
  if (has("B200")) return 2250.0;
  return 0.0;
}

std::string format_progress_line(const StepMetrics& m) {
  char rate[32];
  if (m.tokens_per_s >= 1e3) {
    std::snprintf(rate, sizeof(rate), "%.1fk", m.tokens_per_s / 1e3);
  } else {
    std::snprintf(rate, sizeof(rate), "%.0f", m.tokens_per_s);
  }
  char acc[32] = "";
  if (m.token_acc >= 0) std::snprintf(acc, sizeof(acc), " | acc %.3f", m.token_acc);
  char device[160] = "";
  if (m.tflops >= 0 && m.mfu >= 0) {
    std::snprintf(device, sizeof(device), " | MFU %.1f%% (%.3g TFLOP/s)", 100.0 * m.mfu, m.tflops);
  } else if (m.tflops >= 0) {
    std::snprintf(device, sizeof(device), " | %.3g TFLOP/s", m.tflops);
  }
  if (m.peak_mem_gib >= 0) {
    const size_t used = std::strlen(device);
    std::snprintf(device + used, sizeof(device) - used, " | mem %.1f GiB", m.peak_mem_gib);
  }
  if (m.h2d_bytes >= 0 && m.d2h_bytes >= 0) {
    const size_t used = std::strlen(device);
    std::snprintf(device + used, sizeof(device) - used, " | h2d %.3g MB d2h %lld B",
                  static_cast<double>(m.h2d_bytes) / 1e6, static_cast<long long>(m.d2h_bytes));
  }
  char line[512];
  std::snprintf(line, sizeof(line),
                "step %lld/%lld | loss %.4f%s | lr %.3g | grad_norm %.3f | %s tok/s%s | %.2f s/step | ETA %s%s",
                static_cast<long long>(m.step), static_cast<long long>(m.total_steps), m.loss, acc, m.lr, m.grad_norm,
                rate, device, m.step_s, format_duration(m.eta_s).c_str(),
                m.skipped ? " | SKIPPED (non-finite gradient norm)" : "");
  return line;
}

namespace {

// The lines of an existing metrics file whose "step" is at most max_step (unparsable lines dropped).
std::string lines_up_to_step(const std::string& path, int64_t max_step) {
  std::ifstream in(path);
  std::string kept, line;
  while (std::getline(in, line)) {
    const nlohmann::json json = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (json.is_object() && json.contains("step") && json["step"].is_number_integer() &&
        json["step"].get<int64_t>() <= max_step) {
      kept += line + "\n";
    }
  }
  return kept;
}

void write_all(int fd, const std::string& text, const std::string& path) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t written = ::write(fd, text.data() + done, text.size() - done);
    if (written < 0 && errno == EINTR) continue;
    CHECK(written > 0, "writing ", path, " failed: ", std::strerror(errno), " (disk full?)");
    done += static_cast<size_t>(written);
  }
}

// path.tmp with `text`, synced, renamed over path, and the rename synced.
void replace_file(const std::string& path, const std::string& text) {
  const std::string temp = path + ".tmp";
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  CHECK(fd >= 0, "cannot create ", temp, ": ", std::strerror(errno));
  try {
    // In two writes, so that the kill test hook can stop the process with the file half written.
    write_all(fd, text.substr(0, text.size() / 2), temp);
    kill_point("metrics_rewrite_partial");
    write_all(fd, text.substr(text.size() / 2), temp);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  fsync_path(temp);
  kill_point("metrics_rewrite");
  std::filesystem::rename(temp, path);
  kill_point("metrics_rewrite_renamed");
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  fsync_path(parent.empty() ? "." : parent.string());
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path, int64_t keep_up_to_step) : path_(path) {
  replace_file(path, keep_up_to_step >= 0 ? lines_up_to_step(path, keep_up_to_step) : std::string());
  fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  CHECK(fd_ >= 0, "cannot open the metrics file ", path, " for appending: ", std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (fd_ >= 0) ::close(fd_);
}

void MetricsLog::write_line(const std::string& line) { write_all(fd_, line + "\n", path_); }

void MetricsLog::write_step(const StepMetrics& m) {
  nlohmann::ordered_json json;
  json["type"] = "train";
  json["step"] = m.step;
  json["total_steps"] = m.total_steps;
  json["epoch"] = m.epoch;
  json["loss"] = m.loss;
  json["ce_loss"] = m.ce_loss;
  json["aux_loss"] = m.aux_loss;
  json["lr"] = m.lr;
  json["grad_norm"] = std::isfinite(m.grad_norm) ? nlohmann::ordered_json(m.grad_norm) : nlohmann::ordered_json();
  json["token_acc"] = m.token_acc >= 0 ? nlohmann::ordered_json(m.token_acc) : nlohmann::ordered_json();
  json["skipped"] = m.skipped;
  json["tokens"] = m.num_tokens;
  json["supervised_tokens"] = m.num_supervised;
  if (m.num_images > 0) {
    json["images"] = m.num_images;
    json["image_tokens"] = m.num_image_tokens;
  }
  json["step_s"] = m.step_s;
  json["data_wait_s"] = m.data_wait_s;
  json["tokens_per_s"] = m.tokens_per_s;
  json["elapsed_s"] = m.elapsed_s;
  if (m.tflops >= 0) json["tflops"] = m.tflops;
  if (m.mfu >= 0) json["mfu"] = m.mfu;
  if (m.peak_mem_gib >= 0) json["peak_mem_gib"] = m.peak_mem_gib;
  if (m.h2d_bytes >= 0) json["h2d_bytes"] = m.h2d_bytes;
  if (m.d2h_bytes >= 0) json["d2h_bytes"] = m.d2h_bytes;
  write_line(json.dump());
}

void MetricsLog::write_eval(int64_t step, double val_loss, double token_acc, int64_t num_supervised) {
  nlohmann::ordered_json json;
  json["type"] = "eval";
  json["step"] = step;
  json["val_loss"] = val_loss;
  json["val_token_acc"] = token_acc >= 0 ? nlohmann::ordered_json(token_acc) : nlohmann::ordered_json();
  json["val_supervised_tokens"] = num_supervised;
  write_line(json.dump());
}

}  // namespace deltamoe
