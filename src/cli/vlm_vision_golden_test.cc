// The vision side of the VLM against transformers: on tests/golden/vlm_* the CPU reference runs
// vision tower -> feature scatter -> 3-D positions -> text model and back, and its logits, losses,
// embed_tokens gradient and every model.visual.* gradient (CE and aux) must match the golden files.
// (It lives with the CLI tests because it needs checkpoint loading and the text model together.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "checkpoint/model_checkpoint.h"
#include "checkpoint/safetensors.h"
#include "kernels/cross_entropy/cross_entropy.h"
#include "model/text/text_model.h"
#include "model/vision/multimodal_embedding.h"
#include "train/parity.h"

namespace deltamoe {
namespace {

namespace fs = std::filesystem;

// Relative error max|got - want| / max|want|, printed under `what`.
double relative_error(const std::string& what, const float* got, const HostTensor& want) {
  double max_diff = 0, max_ref = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    max_diff = std::max(max_diff, static_cast<double>(std::abs(got[i] - want.as<float>()[i])));
    max_ref = std::max(max_ref, static_cast<double>(std::abs(want.as<float>()[i])));
  }
  const double relative = max_diff / std::max(max_ref, 1e-30);
  std::printf("  %-58s max|diff| %.3e max|ref| %.3e rel %.3e\n", what.c_str(), max_diff, max_ref, relative);
  return relative;
}

void check_case(const std::string& name) {
  const char* source = std::getenv("DELTAMOE_SOURCE_DIR");
  const fs::path folder = fs::path(source != nullptr ? source : ".") / "tests" / "golden" / name;
  ASSERT_TRUE(fs::exists(folder / "expected.safetensors"))
      << "golden files are missing: " << folder << " (made by tools/golden/make_golden.py)";
  const ModelCheckpoint checkpoint = load_model_dir((folder / "model").string());
  const ParityInputs inputs = load_parity_inputs((folder / "inputs.safetensors").string());
  const auto expected = SafetensorsFile::open((folder / "expected.safetensors").string());
  const ModelConfig& config = checkpoint.config;
  const std::string prefix = config.text_prefix();
  ASSERT_TRUE(inputs.pixel_values && inputs.image_grid_thw) << name << " has no images";
  const int64_t rows = inputs.input_ids.shape()[0], seq_len = inputs.input_ids.shape()[1], tokens = rows * seq_len;
  const int64_t* ids = inputs.input_ids.as<int64_t>();

  VisionParams vision_params;
  for (const auto& [param, shape] : vision_param_shapes(config.vision)) {
    vision_params[param] = checkpoint.params.at(param).to_host().to_f32();
  }
  ParamMap text_params;
  for (const NamedShape& spec : text_param_shapes(config.text, prefix)) {
    const HostTensor values = checkpoint.params.at(spec.name).to_host().to_f32();
    text_params[spec.name] = {values.shape().to_vector(),
                              std::vector<float>(values.as<float>(), values.as<float>() + values.numel())};
  }
  const std::string table_name = prefix + ".embed_tokens.weight";
  const std::vector<int32_t> cu_seqlens = row_cu_seqlens(rows, seq_len);
  const MultimodalEmbedding embedding =
      multimodal_embed_forward(config, vision_params, text_params.at(table_name).values.data(), ids, tokens, cu_seqlens,
                               &*inputs.pixel_values, &*inputs.image_grid_thw);

  std::vector<int64_t> shifted(tokens);
  shift_labels_ref(inputs.labels.as<int64_t>(), shifted.data(), rows, seq_len);
  TextModel model(config.text, prefix, &text_params);
  TextModelInputs model_inputs;
  model_inputs.input_ids = ids;
  model_inputs.input_embeds = embedding.input_embeds.data();
  model_inputs.shifted_labels = shifted.data();
  const TextModelOutput out = model.forward(make_text_batch(config.text, tokens, cu_seqlens, embedding.positions),
                                            model_inputs);
  const double golden_ce = expected->tensor("ce_loss").to_host().as<float>()[0];
  std::printf("  ce_loss %.7f (golden %.7f), aux_loss %.7f (golden %.7f)\n", out.ce_loss, golden_ce, out.aux_loss,
              expected->tensor("aux_loss").to_host().as<float>()[0]);
  EXPECT_NEAR(out.ce_loss, golden_ce, 1e-4 * std::abs(golden_ce));
  EXPECT_LT(relative_error("logits", out.logits.data(), expected->tensor("logits").to_host()), 1e-4);

  for (const char* loss : {"grad.", "grad_aux."}) {
    const bool ce = std::string(loss) == "grad.";
    std::vector<float> d_embeds;
    model.backward(ce ? 1.0f : 0.0f, ce ? 0.0f : 1.0f, &d_embeds);
    std::vector<float> d_table(text_params.at(table_name).values.size(), 0.0f);
    VisionParams vision_grads;
    multimodal_embed_backward(config, vision_params, embedding, ids, tokens, d_embeds, d_table.data(), &vision_grads);
    EXPECT_LT(relative_error(loss + table_name, d_table.data(), expected->tensor(loss + table_name).to_host()), 1e-4);
    ASSERT_EQ(vision_grads.size(), static_cast<size_t>(9 + 12 * config.vision.depth));
    for (const auto& [param, grad] : vision_grads) {
      ASSERT_TRUE(expected->contains(loss + param)) << "golden file lacks " << loss << param;
      EXPECT_LT(relative_error(loss + param, grad.as<float>(), expected->tensor(loss + param).to_host()), 1e-4)
          << param;
    }
  }
}

TEST(VlmVisionGolden, TwoImagesInOneSample) { check_case("vlm_two_images"); }
TEST(VlmVisionGolden, ImageFirstAndTwoRows) { check_case("vlm_image_first"); }

}  // namespace
}  // namespace deltamoe
