// libFuzzer target: the input as a whole safetensors file (written to a memfd and opened by path,
// as checkpoints are), then every tensor's bytes read and scanned for NaN/Inf.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <string>
#include <vector>

#include "checkpoint/finite_check.h"
#include "checkpoint/safetensors.h"
#include "core/error.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  if (fd < 0) return 0;
  size_t done = 0;
  while (done < size) {
    const ssize_t written = write(fd, data + done, size - done);
    if (written <= 0) break;
    done += static_cast<size_t>(written);
  }
  try {
    const auto file = deltamoe::SafetensorsFile::open("/proc/self/fd/" + std::to_string(fd));
    for (const deltamoe::SafetensorsEntry& entry : file->entries()) {
      const deltamoe::StoredTensor tensor = file->tensor(entry.name);
      std::vector<uint8_t> bytes(tensor.nbytes());
      tensor.read_into(bytes.data());
      deltamoe::first_non_finite_element(tensor);
    }
  } catch (const deltamoe::Error&) {
  }
  close(fd);
  return 0;
}
