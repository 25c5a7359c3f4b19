// HostViewComm: host-pointer semantics over a device communicator, so that the host conformance
// checks (run_comm_selftest) run unchanged on NcclComm and DeviceLoopbackComm: each call mirrors
// its host buffers on the GPU (overlapping buffers share one device block, so in-place forms stay
// in place), runs the device communicator on its own stream, waits and copies the outputs back.
// For tests and `deltamoe comm-selftest --device cuda`; it allocates per call.
#pragma once

#include <memory>

#include "parallel/communicator.h"

namespace deltamoe {

// A view of `device_comm` (which must outlive it unless passed in `owned`).
std::unique_ptr<Communicator> make_host_view_comm(Communicator& device_comm, std::unique_ptr<Communicator> owned = nullptr);

}  // namespace deltamoe
