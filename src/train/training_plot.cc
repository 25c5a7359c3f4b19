// Rendering of the training plot (see training_plot.h): an RGB canvas, a 5x7 bitmap font drawn at
// twice its size, four line charts with labelled axes, and a PNG writer.
#include "train/training_plot.h"

#include <png.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"

namespace deltamoe {
namespace {

struct Rgb {
  uint8_t r, g, b;
};
constexpr Rgb kWhite{255, 255, 255}, kBlack{30, 30, 30}, kGrid{225, 225, 225}, kBlue{31, 119, 180},
    kOrange{255, 127, 14};

// 5x7 glyphs, one row per entry, bit 4 the leftmost column; letters with a descender are drawn two
// rows lower (their x-height part first).
struct Glyph {
  char c;
  uint8_t rows[7];
  bool descender = false;
};
constexpr Glyph kFont[] = {
    {'0', {14, 17, 19, 21, 25, 17, 14}}, {'1', {4, 12, 4, 4, 4, 4, 14}},    {'2', {14, 17, 1, 2, 4, 8, 31}},
    {'3', {31, 2, 4, 2, 1, 17, 14}},     {'4', {2, 6, 10, 18, 31, 2, 2}},   {'5', {31, 16, 30, 1, 1, 17, 14}},
    {'6', {6, 8, 16, 30, 17, 17, 14}},   {'7', {31, 1, 2, 4, 8, 8, 8}},     {'8', {14, 17, 17, 14, 17, 17, 14}},
    {'9', {14, 17, 17, 15, 1, 2, 12}},   {'a', {0, 0, 14, 1, 15, 17, 15}},  {'b', {16, 16, 22, 25, 17, 17, 30}},
    {'c', {0, 0, 14, 16, 16, 17, 14}},   {'d', {1, 1, 13, 19, 17, 17, 15}}, {'e', {0, 0, 14, 17, 31, 16, 14}},
    {'f', {6, 9, 8, 28, 8, 8, 8}},       {'g', {15, 17, 17, 17, 15, 1, 14}, true}, {'h', {16, 16, 22, 25, 17, 17, 17}},
    {'i', {4, 0, 12, 4, 4, 4, 14}},      {'j', {2, 0, 6, 2, 2, 18, 12}},    {'k', {16, 16, 18, 20, 24, 20, 18}},
    {'l', {12, 4, 4, 4, 4, 4, 14}},      {'m', {0, 0, 26, 21, 21, 17, 17}}, {'n', {0, 0, 22, 25, 17, 17, 17}},
    {'o', {0, 0, 14, 17, 17, 17, 14}},   {'p', {30, 17, 17, 17, 30, 16, 16}, true}, {'q', {15, 17, 17, 17, 15, 1, 1}, true},
    {'r', {0, 0, 22, 25, 16, 16, 16}},   {'s', {0, 0, 14, 16, 14, 1, 30}},  {'t', {8, 8, 28, 8, 8, 9, 6}},
    {'u', {0, 0, 17, 17, 17, 19, 13}},   {'v', {0, 0, 17, 17, 17, 10, 4}},  {'w', {0, 0, 17, 17, 21, 21, 10}},
    {'x', {0, 0, 17, 10, 4, 10, 17}},    {'y', {17, 17, 17, 17, 15, 1, 14}, true},  {'z', {0, 0, 31, 2, 4, 8, 31}},
    {'.', {0, 0, 0, 0, 0, 12, 12}},      {'-', {0, 0, 0, 31, 0, 0, 0}},     {'+', {0, 4, 4, 31, 4, 4, 0}},
    {'/', {0, 1, 2, 4, 8, 16, 0}},       {':', {0, 12, 12, 0, 12, 12, 0}},  {'(', {2, 4, 8, 8, 8, 4, 2}},
    {')', {8, 4, 2, 2, 2, 4, 8}},        {'%', {24, 25, 2, 4, 8, 19, 3}},   {'_', {0, 0, 0, 0, 0, 0, 31}},
    {',', {0, 0, 0, 0, 12, 4, 8}},       {'=', {0, 0, 31, 0, 31, 0, 0}},
};
constexpr int kScale = 2;
constexpr int kCharWidth = 6 * kScale;  // 5 columns and a space

class Canvas {
 public:
  Canvas(int width, int height) : width_(width), height_(height), pixels_(static_cast<size_t>(width * height * 3), 255) {}
  int width() const { return width_; }
  int height() const { return height_; }
  const std::vector<uint8_t>& pixels() const { return pixels_; }

  void set(int x, int y, Rgb color) {
    if (x < 0 || y < 0 || x >= width_ || y >= height_) return;
    uint8_t* p = &pixels_[static_cast<size_t>((y * width_ + x) * 3)];
    p[0] = color.r, p[1] = color.g, p[2] = color.b;
  }
  void fill(int x0, int y0, int x1, int y1, Rgb color) {
    for (int y = y0; y <= y1; ++y) {
      for (int x = x0; x <= x1; ++x) set(x, y, color);
    }
  }
  // A line two pixels wide (Bresenham, with the pixel below each point).
  void line(int x0, int y0, int x1, int y1, Rgb color, int thickness = 2) {
    const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int error = dx + dy;
    for (;;) {
      for (int t = 0; t < thickness; ++t) set(x0, y0 + t, color), set(x0 + t, y0, color);
      if (x0 == x1 && y0 == y1) break;
      const int e2 = 2 * error;
      if (e2 >= dy) error += dy, x0 += sx;
      if (e2 <= dx) error += dx, y0 += sy;
    }
  }
  void text(int x, int y, const std::string& text, Rgb color) {
    for (char raw : text) {
      const char c = static_cast<char>(std::tolower(static_cast<unsigned char>(raw)));
      for (const Glyph& glyph : kFont) {
        if (glyph.c != c) continue;
        const int top = y + (glyph.descender ? 2 * kScale : 0);
        for (int row = 0; row < 7; ++row) {
          for (int col = 0; col < 5; ++col) {
            if ((glyph.rows[row] >> (4 - col)) & 1) {
              fill(x + col * kScale, top + row * kScale, x + col * kScale + kScale - 1, top + row * kScale + kScale - 1, color);
            }
          }
        }
      }
      x += kCharWidth;
    }
  }

 private:
  int width_, height_;
  std::vector<uint8_t> pixels_;
};

std::string number_text(double value) {
  char text[32];
  const double magnitude = std::abs(value);
  std::snprintf(text, sizeof(text), magnitude >= 1e-3 && magnitude < 1e6 ? "%.4g" : "%.3g", value);
  return text;
}

struct Series {
  std::vector<double> x, y;
  Rgb color;
};

// One chart: title, frame, grid with five labelled y ticks and up to six x ticks, the series.
void draw_panel(Canvas& canvas, int left, int top, int width, int height, const std::string& title,
                const std::vector<Series>& series) {
  canvas.text(left + 110, top + 4, title, kBlack);
  const int x0 = left + 110, x1 = left + width - 24, y0 = top + 30, y1 = top + height - 40;  // room for 8-digit labels
  double min_x = 1e300, max_x = -1e300, min_y = 1e300, max_y = -1e300;
  for (const Series& s : series) {
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      min_x = std::min(min_x, s.x[i]), max_x = std::max(max_x, s.x[i]);
      min_y = std::min(min_y, s.y[i]), max_y = std::max(max_y, s.y[i]);
    }
  }
  if (min_x > max_x) {
    canvas.text(x0 + 10, (y0 + y1) / 2, "no data", kBlack);
    return;
  }
  if (max_x == min_x) max_x = min_x + 1;
  if (max_y == min_y) {
    const double pad = std::max(std::abs(max_y) * 0.1, 1e-12);
    min_y -= pad, max_y += pad;
  }
  const double span_y = max_y - min_y;
  const bool non_negative = min_y >= 0;
  min_y -= 0.05 * span_y, max_y += 0.05 * span_y;
  if (non_negative) min_y = std::max(min_y, 0.0);  // a learning rate from 0 keeps its axis at 0
  const auto px = [&](double x) { return x0 + static_cast<int>(std::lround((x - min_x) / (max_x - min_x) * (x1 - x0))); };
  const auto py = [&](double y) { return y1 - static_cast<int>(std::lround((y - min_y) / (max_y - min_y) * (y1 - y0))); };
  for (int tick = 0; tick <= 4; ++tick) {
    const double value = min_y + (max_y - min_y) * tick / 4.0;
    const int y = py(value);
    canvas.line(x0, y, x1, y, kGrid, 1);
    const std::string label = number_text(value);
    canvas.text(x0 - 6 - static_cast<int>(label.size()) * kCharWidth, y - 7, label, kBlack);
  }
  const int num_x_ticks = static_cast<int>(std::min<double>(5, max_x - min_x));
  for (int tick = 0; tick <= num_x_ticks; ++tick) {
    const double value = std::round(min_x + (max_x - min_x) * tick / std::max(1, num_x_ticks));
    const int x = px(value);
    canvas.line(x, y0, x, y1, kGrid, 1);
    const std::string label = number_text(value);
    canvas.text(x - static_cast<int>(label.size()) * kCharWidth / 2, y1 + 8, label, kBlack);
  }
  canvas.text((x0 + x1) / 2 - 2 * kCharWidth, y1 + 24, "step", kBlack);
  canvas.line(x0, y0, x0, y1, kBlack, 1), canvas.line(x0, y1, x1, y1, kBlack, 1);
  canvas.line(x1, y0, x1, y1, kBlack, 1), canvas.line(x0, y0, x1, y0, kBlack, 1);
  for (const Series& s : series) {
    bool have_last = false;
    int last_x = 0, last_y = 0;
    for (size_t i = 0; i < s.x.size(); ++i) {
      if (!std::isfinite(s.y[i])) {
        have_last = false;  // a gap where the value was NaN / Inf
        continue;
      }
      const int x = px(s.x[i]), y = py(s.y[i]);
      if (have_last) canvas.line(last_x, last_y, x, y, s.color);
      if (s.x.size() < 60 || !have_last) canvas.fill(x - 2, y - 2, x + 2, y + 2, s.color);  // few points: marks too
      last_x = x, last_y = y, have_last = true;
    }
  }
}

// libpng reports errors by longjmp: nothing here needs destroying when it jumps.
bool write_png_rows(png_structp png, png_infop info, FILE* file, const Canvas& canvas) {
  if (setjmp(png_jmpbuf(png)) != 0) return false;
  png_init_io(png, file);
  png_set_IHDR(png, info, static_cast<png_uint_32>(canvas.width()), static_cast<png_uint_32>(canvas.height()), 8,
               PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_write_info(png, info);
  for (int y = 0; y < canvas.height(); ++y) {
    png_write_row(png, const_cast<png_bytep>(canvas.pixels().data() + static_cast<size_t>(y * canvas.width() * 3)));
  }
  png_write_end(png, nullptr);
  return true;
}

void write_png(const Canvas& canvas, const std::string& path) {
  FILE* file = std::fopen(path.c_str(), "wb");
  CHECK(file != nullptr, "cannot create ", path);
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png != nullptr ? png_create_info_struct(png) : nullptr;
  const bool ok = png != nullptr && info != nullptr && write_png_rows(png, info, file, canvas);
  png_destroy_write_struct(&png, &info);
  const bool closed = std::fclose(file) == 0;
  CHECK(ok && closed, "writing the plot ", path, " failed");
}

double number_or_nan(const nlohmann::json& json, const char* key) {
  return json.contains(key) && json[key].is_number() ? json[key].get<double>() : std::nan("");
}

}  // namespace

bool write_training_plot(const std::string& metrics_path, const std::string& png_path) {
  Series loss{{}, {}, kBlue}, val_loss{{}, {}, kOrange}, lr{{}, {}, kBlue}, grad_norm{{}, {}, kBlue},
      tokens{{}, {}, kBlue};
  std::ifstream in(metrics_path);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json json = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!json.is_object() || !json.contains("step") || !json["step"].is_number()) continue;
    const double step = json["step"].get<double>();
    if (json.value("type", "") == "eval") {
      val_loss.x.push_back(step), val_loss.y.push_back(number_or_nan(json, "val_loss"));
      continue;
    }
    loss.x.push_back(step), loss.y.push_back(number_or_nan(json, "loss"));
    lr.x.push_back(step), lr.y.push_back(number_or_nan(json, "lr"));
    grad_norm.x.push_back(step), grad_norm.y.push_back(number_or_nan(json, "grad_norm"));
    tokens.x.push_back(step), tokens.y.push_back(number_or_nan(json, "tokens_per_s"));
  }
  if (loss.x.empty()) return false;
  constexpr int kWidth = 1280, kHeight = 880;
  Canvas canvas(kWidth, kHeight);
  canvas.fill(0, 0, kWidth - 1, kHeight - 1, kWhite);
  const int w = kWidth / 2, h = kHeight / 2;
  draw_panel(canvas, 0, 0, w, h, val_loss.x.empty() ? "loss" : "loss (blue) and val_loss (orange)", {loss, val_loss});
  draw_panel(canvas, w, 0, w, h, "learning rate", {lr});
  draw_panel(canvas, 0, h, w, h, "gradient norm", {grad_norm});
  draw_panel(canvas, w, h, w, h, "tokens/s", {tokens});
  std::filesystem::create_directories(std::filesystem::path(png_path).parent_path());
  const std::string temp = png_path + ".tmp";
  write_png(canvas, temp);
  std::filesystem::rename(temp, png_path);
  return true;
}

}  // namespace deltamoe
