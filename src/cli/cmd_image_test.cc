// End-to-end test of 'deltamoe image' through the built binary ($DELTAMOE_BINARY): the written
// safetensors file holds what preprocess_image computes, and a broken image fails with its name.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>

#include "checkpoint/safetensors.h"
#include "data/image_preprocess.h"
#include "data/image_test_util.h"
#include "testing/run_deltamoe.h"

namespace deltamoe {
namespace {

TEST(CmdImage, WritesPixelValuesAndGridThw) {
  const RgbImage image = image_test::gradient_image(70, 130);
  const std::string in = image_test::write_temp_file("cmd_image.png", image_test::encode_png_rgb(image));
  const std::string out = in + ".safetensors";
  const CommandResult run =
      run_deltamoe("image --in " + in + " --out " + out + " --min_pixels 4096 --max_pixels 20000");
  std::printf("%s", run.output.c_str());
  ASSERT_EQ(run.exit_code, 0);

  ImagePreprocessConfig config;
  config.min_pixels = 4096;
  config.max_pixels = 20000;
  const ImagePatches expected = preprocess_image(image, config);
  const auto file = SafetensorsFile::open(out);
  const HostTensor grid = file->tensor("image_grid_thw").to_host();
  const HostTensor pixels = file->tensor("pixel_values").to_host();
  ASSERT_EQ(grid.dtype(), DType::i64);
  ASSERT_EQ(grid.shape(), (Shape{1, 3}));
  for (int axis = 0; axis < 3; ++axis) EXPECT_EQ(grid.as<int64_t>()[axis], expected.grid_thw[axis]);
  ASSERT_EQ(pixels.dtype(), DType::f32);
  ASSERT_EQ(pixels.shape(), (Shape{expected.num_patches(), 1536}));
  double max_diff = 0;
  for (int64_t i = 0; i < pixels.numel(); ++i) {
    max_diff = std::max(max_diff, static_cast<double>(std::abs(pixels.as<float>()[i] - expected.pixel_values[i])));
  }
  std::printf("  pixel_values max|diff| vs preprocess_image = %.3e\n", max_diff);
  EXPECT_EQ(max_diff, 0.0);
}

TEST(CmdImage, BrokenImageFailsNamingTheFile) {
  const std::string in = image_test::write_temp_file("cmd_image_broken.jpg", {0xFF, 0xD8, 0xFF, 0xE0, 0, 16, 'J'});
  const CommandResult run = run_deltamoe("image --in " + in + " --out " + in + ".safetensors");
  std::printf("%s", run.output.c_str());
  EXPECT_EQ(run.exit_code, 1);
  EXPECT_NE(run.output.find(in), std::string::npos);
}

}  // namespace
}  // namespace deltamoe
