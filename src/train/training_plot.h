// The picture of a run at its end (ms-swift writes such images too): OUTPUT_DIR/images/training.png
// with four panels over the steps — loss (and validation loss), learning rate, gradient norm and
// tokens/s — drawn from metrics.jsonl (so a resumed run's plot covers the whole run) with a small
// built-in font and written with libpng.
#pragma once

#include <string>

namespace deltamoe {

// Reads metrics_path ("train" and "eval" lines) and writes png_path (its folder is created).
// Returns false, writing nothing, when the file has no step; throws naming png_path when it cannot
// be written.
bool write_training_plot(const std::string& metrics_path, const std::string& png_path);

}  // namespace deltamoe
