// MirrorComm: a simulated world of N ranks in which every other rank is an exact copy of this one
// (same inputs, same routing), for `deltamoe bench --simulate_expert_parallel N` (design §4.4):
// one process runs exactly one rank's share of an N-GPU step. Each collective returns what it
// would return in such a world, and moves the bytes a real rank would receive with same-size
// device copies on the stream instead of NVLink transfers:
//   all_reduce / reduce_scatter: the rank-ordered sum of N equal blocks (max: the block itself);
//   all_gather: this rank's block in every slot (mirrored() is true: a ZeRO rank takes only its own
//   slot back into its weights, the other pieces stay as they were);
//   all_to_all: from every peer, what this rank sends to itself (a copy would route to this rank
//   exactly what this rank routes to itself); grouped send/recv: the same when the counts agree,
//   else the receive's bytes from this rank's sends (mirror_comm.cu, do_group_end).
// The control plane's all-gathers and votes return N copies of this rank's contribution. Splits
// assume every peer chooses this rank's color (the simulated layouts have EP = world), so a
// split is a mirror of the same size. Device buffers only. Not a communicator for real training.
#pragma once

#include <memory>

#include "parallel/communicator.h"

namespace deltamoe {

// A mirror world of `size` ranks seen from rank `rank`; `host` (a one-rank host world, not owned,
// outliving the result) provides the activity record and abort.
std::unique_ptr<Communicator> make_mirror_comm(Communicator& host, int rank, int size);

}  // namespace deltamoe
