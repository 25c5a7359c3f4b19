// NcclComm: the Communicator over NCCL for device buffers and CUDA streams, one process per GPU.
// Bootstrapped through the job's host world (its control plane carries NCCL's unique id), created
// nonblocking so that every host wait is a poll over NCCL's async state, the job's abort flag and
// the deadline: a dead or stuck peer ends in CommAborted with a message instead of a hang.
// NVLink multicast (NVLS) is never requested: NCCL_NVLS_ENABLE is forced to 0 before the first
// communicator is made. Reductions follow NCCL's order, not the host backends' rank order; with
// one rank the results are those of the host backends bitwise.
#pragma once

#include <memory>

#include "parallel/comm_options.h"
#include "parallel/communicator.h"

namespace deltamoe {

// Joins the NCCL communicator of `host_world`'s job on CUDA device `device` (collective over
// host_world: every rank calls it). The returned communicator shares host_world's control plane,
// activity and abort; host_world must outlive it. Throws deltamoe::Error naming NCCL's message
// when NCCL cannot be set up, CommAborted when the job aborts or the deadline
// (options.timeout_seconds) passes while waiting for the other ranks.
std::unique_ptr<Communicator> make_nccl_comm(Communicator& host_world, int device, const CommOptions& options);

// NCCL's version as "2.28.9" (the library loaded at run time).
std::string nccl_runtime_version();

}  // namespace deltamoe
