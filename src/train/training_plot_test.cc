// The end-of-run plot: a PNG that deltamoe's own decoder reads, of the expected size, with the
// train-loss colour and the validation-loss colour drawn, from a metrics file with a NaN step (a gap,
// not a failure); no file for a run without steps.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "data/image_decode.h"
#include "train/training_plot.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

int64_t count_colour(const RgbImage& image, uint8_t r, uint8_t g, uint8_t b) {
  int64_t count = 0;
  for (int64_t i = 0; i < image.height * image.width; ++i) {
    count += image.pixels[i * 3] == r && image.pixels[i * 3 + 1] == g && image.pixels[i * 3 + 2] == b;
  }
  return count;
}

TEST(TrainingPlot, DrawsFourPanelsAsAPng) {
  const fs::path dir = fs::temp_directory_path() / ("deltamoe_plot_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    std::ofstream metrics(dir / "metrics.jsonl");
    metrics << R"({"type": "eval", "step": 0, "val_loss": 9.0})" << "\n";
    for (int step = 1; step <= 40; ++step) {
      const double loss = step == 17 ? std::nan("") : 8.0 / step;
      metrics << "{\"type\": \"train\", \"step\": " << step << ", \"loss\": " << (std::isnan(loss) ? "null" : std::to_string(loss))
              << ", \"lr\": " << 1e-4 * step / 40 << ", \"grad_norm\": " << 1.0 + step % 3 << ", \"tokens_per_s\": " << 1000 + step
              << "}\n";
    }
    metrics << R"({"type": "eval", "step": 40, "val_loss": 1.5})" << "\n";
  }
  const std::string png = (dir / "images" / "training.png").string();
  ASSERT_TRUE(write_training_plot((dir / "metrics.jsonl").string(), png));
  std::ifstream in(png, std::ios::binary);
  const std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const RgbImage image = decode_image(bytes.data(), bytes.size(), png);
  EXPECT_EQ(image.width, 1280);
  EXPECT_EQ(image.height, 880);
  const int64_t blue = count_colour(image, 31, 119, 180), orange = count_colour(image, 255, 127, 14);
  const int64_t white = count_colour(image, 255, 255, 255);
  std::printf("  blue %lld, orange %lld, white %lld of %lld pixels\n", static_cast<long long>(blue),
              static_cast<long long>(orange), static_cast<long long>(white),
              static_cast<long long>(image.height * image.width));
  EXPECT_GT(blue, 4 * 500) << "four series in blue";
  EXPECT_GT(orange, 200) << "the validation loss in orange";
  EXPECT_GT(white, image.height * image.width * 8 / 10) << "mostly background";
  // No steps: nothing written.
  std::ofstream(dir / "empty.jsonl") << R"({"type": "eval", "step": 0, "val_loss": 9.0})" << "\n";
  EXPECT_FALSE(write_training_plot((dir / "empty.jsonl").string(), (dir / "none.png").string()));
  EXPECT_FALSE(fs::exists(dir / "none.png"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace deltamoe
