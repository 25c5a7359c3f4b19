// The pixels of micro-batches packed from measured samples (SampleOptions::measure_images_only:
// token ids, labels and image grids from the files' headers, no pixels). Packing needs only the
// lengths, so a data-parallel rank packs every micro-batch of a global batch that way and then
// reads, decodes and preprocesses the images of its own micro-batches alone (train/step_batch_reader.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "data/packer.h"
#include "data/sample_builder.h"
#include "data/sample_skip.h"
#include "data/sample_source.h"

namespace deltamoe {

// A sample taken out of its micro-batch because its image failed only now (data corrupt after a
// good header, or a patch grid other than the header promised).
struct DroppedSample {
  int64_t sample_index = -1;
  SkipReason reason = SkipReason::kBadImage;
  std::string message;
};

// Fills each batch's pixel_values (images in token order) by loading the images of each sample
// again from its dataset line, on up to `threads` threads (at least 1). A sample whose image fails
// is removed from its batch (tokens, labels, positions, grids, counts) and returned; the batch
// keeps its other samples. Throws when the files no longer match the batch (a line without the
// images its tokens hold).
std::vector<DroppedSample> load_batch_images(const std::vector<MicroBatch*>& batches, const DatasetFiles& files,
                                             const SampleOptions& options, int threads);

}  // namespace deltamoe
