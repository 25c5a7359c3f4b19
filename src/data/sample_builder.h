// Turns a parsed dataset line into a training sample: loads the images, renders the chat, tokenizes,
// marks supervised tokens (assistant answers and their <|im_end|>), expands each <|image_pad|> to the
// image's t*h*w/m^2 tokens, applies --max_length (drop or truncate) and computes 3-D positions.
#pragma once

#include <cstdint>
#include <string>

#include "data/image_preprocess.h"
#include "data/sample_image.h"
#include "data/sft_record.h"
#include "data/sft_sample.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace deltamoe {

struct SampleOptions {
  ChatFormat chat_format = ChatFormat::kQwen35;
  ChatOptions chat_options;
  // Supervise every token except image pads (pre-training style) instead of assistant turns only.
  bool supervise_all = false;
  int64_t max_length = 0;  // 0: no limit
  bool truncate = false;   // over max_length: cut (true) or drop the sample (false)
  ImagePreprocessConfig image_config;
  ImageReadLimits image_limits;  // file size and decoded pixel caps (bigger images are skipped)
  bool allow_images = true;  // false for text-only models: samples with images are skipped (unsupported)
  std::string media_dir;     // --media_dir: the root of relative image paths ("": working directory, then the file's folder)
  // Image grids from the files' headers, no pixels (the pass before step 1 that counts tokens).
  bool measure_images_only = false;
};

class SampleBuilder {
 public:
  // Looks up <|image_pad|> in the tokenizer (throws naming it when missing).
  SampleBuilder(Tokenizer tokenizer, SampleOptions options);

  // Throws SampleSkip for anything wrong with this sample; `where` is file:line.
  SftSample build(const SftRecord& record, int64_t sample_index, const std::string& where) const;

  const SampleOptions& options() const { return options_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }
  int32_t image_token_id() const { return image_token_id_; }

 private:
  Tokenizer tokenizer_;
  SampleOptions options_;
  int32_t image_token_id_;
};

}  // namespace deltamoe
