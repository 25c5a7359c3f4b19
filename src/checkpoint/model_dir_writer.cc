// Several writers of one model directory (see model_dir_writer.h).
#include "checkpoint/model_dir_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>

#include "core/error.h"

namespace deltamoe {

namespace fs = std::filesystem;

namespace {

// An open file descriptor, closed when it goes.
struct Fd {
  int fd = -1;
  Fd() = default;
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

uint64_t ModelDirLayout::metadata_bytes() const {
  uint64_t bytes = contents.config_text.size() + plan.index_text.size();
  for (const SafetensorsLayout& file : files) bytes += file.prefix.size();
  return bytes;
}

ModelDirLayout plan_model_dir(const ModelCheckpoint& checkpoint, const SaveOptions& options) {
  ModelDirLayout layout;
  layout.contents = model_dir_contents(checkpoint, options, "a model directory");
  layout.plan = plan_weights_dir(layout.contents.tensors, options.max_shard_bytes);
  const size_t count = layout.contents.tensors.size();
  layout.file_of.assign(count, 0);
  layout.file_offset.assign(count, 0);
  for (size_t f = 0; f < layout.plan.files.size(); ++f) {
    const std::vector<size_t>& members = layout.plan.files[f].tensors;
    layout.files.push_back(
        safetensors_layout(layout.plan.tensors_of(f, layout.contents.tensors), {}, layout.plan.files[f].name));
    for (size_t i = 0; i < members.size(); ++i) {
      layout.file_of[members[i]] = f;
      layout.file_offset[members[i]] = layout.files.back().offsets[i];
    }
  }
  return layout;
}

void create_model_dir_files(const ModelDirLayout& layout, const std::string& dir) {
  write_model_config(layout.contents, dir);
  write_weights_index(dir, layout.plan);
  for (size_t f = 0; f < layout.files.size(); ++f) {
    const std::string path = (fs::path(dir) / layout.plan.files[f].name).string();
    Fd file;
    file.fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    CHECK(file.fd >= 0, "cannot create ", path, ": ", std::strerror(errno));
    const SafetensorsLayout& planned = layout.files[f];
    CHECK(::ftruncate(file.fd, static_cast<off_t>(planned.file_size)) == 0, "cannot size ", path, " to ",
          planned.file_size, " bytes: ", std::strerror(errno));
    size_t done = 0;
    while (done < planned.prefix.size()) {
      const ssize_t n = ::pwrite(file.fd, planned.prefix.data() + done, planned.prefix.size() - done,
                                 static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      CHECK(n > 0, "writing the header of ", path, " failed: ", std::strerror(errno), " (disk full?)");
      done += static_cast<size_t>(n);
    }
    CHECK(::fsync(file.fd) == 0, "fsync of ", path, " failed: ", std::strerror(errno));
  }
}

void write_model_dir_ranges(const ModelDirLayout& layout, const std::string& dir,
                            const std::vector<TensorByteRange>& ranges) {
  std::map<size_t, Fd> open_files;  // by plan file
  for (const TensorByteRange& range : ranges) {
    CHECK(range.tensor < layout.contents.tensors.size(), "write_model_dir_ranges: tensor ", range.tensor,
          " is not in the layout");
    const size_t f = layout.file_of[range.tensor];
    const std::string path = (fs::path(dir) / layout.plan.files[f].name).string();
    Fd& file = open_files[f];
    if (file.fd < 0) {
      file.fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
      CHECK(file.fd >= 0, "cannot open ", path, " to write its tensors: ", std::strerror(errno));
    }
    const NamedTensor& tensor = layout.contents.tensors[range.tensor];
    pwrite_tensor_bytes(file.fd, tensor.tensor, range.begin, range.end, layout.file_offset[range.tensor] + range.begin,
                        path, tensor.name);
  }
  for (auto& [f, file] : open_files) {
    CHECK(::fsync(file.fd) == 0, "fsync of ", (fs::path(dir) / layout.plan.files[f].name).string(), " failed: ",
          std::strerror(errno));
  }
}

}  // namespace deltamoe
