// A timeline of a CUDA program's GPU work without Nsight Systems (not on the GPU machine): loaded with
// LD_PRELOAD, it turns on CUPTI's activity records for kernels, copies and fills, and writes one
// CSV row per record at exit: start and end on the GPU, and when the host queued and submitted it.
// kernel_trace.py reads the rows: where the GPU sat idle between kernels, and before which kernel.
// Unlike Nsight Compute, kernels run as the program launches them (no serialisation, no replay).
// Build: g++ -O2 -shared -fPIC kernel_trace.cc -I$CUDA/include -L$CUDA/lib -lcupti -o libkernel_trace.so
// Use:   KERNEL_TRACE_OUT=trace.csv LD_PRELOAD=libkernel_trace.so program args...
#include <cupti.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>

namespace {

constexpr size_t kBufferBytes = 16u << 20;

std::mutex file_mutex;
FILE* out = nullptr;

void check(CUptiResult result, const char* what) {
  if (result == CUPTI_SUCCESS) return;
  const char* text = nullptr;
  cuptiGetResultString(result, &text);
  std::fprintf(stderr, "kernel_trace: %s failed: %s\n", what, text != nullptr ? text : "?");
}

std::string demangled(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  char* plain = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string result = status == 0 && plain != nullptr ? plain : name;
  std::free(plain);
  // The CSV's last column: commas stay (arguments lists), quotes would break it.
  for (char& c : result)
    if (c == '"') c = '\'';
  return result;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void write_record(const CUpti_Activity* record) {
  switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      std::fprintf(out, "kernel,%llu,%llu,%u,%llu,%llu,%dx%dx%d,%dx%dx%d,\"%s\"\n",
                   static_cast<unsigned long long>(k->start), static_cast<unsigned long long>(k->end), k->streamId,
                   static_cast<unsigned long long>(k->queued), static_cast<unsigned long long>(k->submitted),
                   k->gridX, k->gridY, k->gridZ, k->blockX, k->blockY, k->blockZ, demangled(k->name).c_str());
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      std::fprintf(out, "memcpy,%llu,%llu,%u,0,0,,,\"memcpy kind %u, %llu bytes\"\n",
                   static_cast<unsigned long long>(m->start), static_cast<unsigned long long>(m->end), m->streamId,
                   static_cast<unsigned>(m->copyKind), static_cast<unsigned long long>(m->bytes));
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      std::fprintf(out, "memset,%llu,%llu,%u,0,0,,,\"memset %llu bytes\"\n",
                   static_cast<unsigned long long>(m->start), static_cast<unsigned long long>(m->end), m->streamId,
                   static_cast<unsigned long long>(m->bytes));
      break;
    }
    default: break;
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  {
    std::lock_guard<std::mutex> lock(file_mutex);
    CUpti_Activity* record = nullptr;
    while (out != nullptr && cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) write_record(record);
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped) == CUPTI_SUCCESS && dropped > 0)
      std::fprintf(stderr, "kernel_trace: %zu records dropped\n", dropped);
  }
  std::free(buffer);
}

void finish() {
  check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::lock_guard<std::mutex> lock(file_mutex);
  if (out != nullptr) std::fclose(out);
  out = nullptr;
}

__attribute__((constructor)) void start() {
  const char* path = std::getenv("KERNEL_TRACE_OUT");
  out = std::fopen(path != nullptr ? path : "kernel_trace.csv", "w");
  if (out == nullptr) {
    std::fprintf(stderr, "kernel_trace: cannot write %s\n", path != nullptr ? path : "kernel_trace.csv");
    return;
  }
  std::fprintf(out, "kind,start_ns,end_ns,stream,queued_ns,submitted_ns,grid,block,name\n");
  check(cuptiActivityEnableLatencyTimestamps(1), "cuptiActivityEnableLatencyTimestamps");
  check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable copies");
  check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable fills");
  std::atexit(finish);
}

}  // namespace
