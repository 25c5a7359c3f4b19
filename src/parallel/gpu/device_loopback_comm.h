// DeviceLoopbackComm: N logical ranks of one process on one GPU, for the GPU tests of N > 1 ranks
// (NCCL refuses two ranks on one GPU). Each rank is a thread with its own device buffers and
// stream; an operation waits for the rank's stream, stages its device inputs in pinned host
// memory, runs the same collective on a host communicator (ThreadComm: rank-ordered reductions,
// bitwise those of every host backend) and copies the results back before it returns. A
// correctness tool, not a fast path: every call synchronises its stream.
#pragma once

#include <functional>
#include <memory>

#include "parallel/comm_options.h"
#include "parallel/communicator.h"

namespace deltamoe {

// Device communicator over `host` (one rank of a host job), on CUDA device `device`. `host` must
// outlive it.
std::unique_ptr<Communicator> make_device_loopback_comm(Communicator& host, int device);

// Runs fn(comm) on `num_ranks` threads of this process, each with its rank of one
// DeviceLoopbackComm world on `device`; errors as run_thread_comm (thread_comm.h).
void run_device_loopback(int num_ranks, int device, const std::function<void(Communicator& comm)>& fn,
                         const CommOptions& options = {});

}  // namespace deltamoe
