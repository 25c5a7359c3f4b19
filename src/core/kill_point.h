// Crash-test hook: DELTAMOE_KILL_AT=<point> or <point>@<step> makes the process send itself
// SIGKILL when it reaches kill_point(point, step), exactly as `kill -9` at that moment would. The
// kill/resume tests use it to stop a run at every phase of a save and of the metrics rewrite.
#pragma once

#include <cstdint>

namespace deltamoe {

// No effect unless DELTAMOE_KILL_AT names this point: <point> (its first call), <point>@<step>
// (the call with this step) or <point>#<n> (the n-th call in this process, for points that know
// no step, such as the middle of a file write).
void kill_point(const char* point, int64_t step = -1);

}  // namespace deltamoe
