// Copies of host memory that nothing reads soon (checkpoint captures): stores that bypass the cache.
#pragma once

#include <cstddef>

namespace commsched {

// Below this many bytes a copy goes through memcpy: the streaming loop's fence and alignment
// work are not worth it, and a small copy pushes little of the training's data out of the cache.
constexpr std::size_t kStreamingCopyMinBytes = 64 * 1024;

// Copies `bytes` from `source` to `destination` (the two must not overlap). From
// kStreamingCopyMinBytes on x86-64 the stores bypass the cache: the destination's lines are
// neither read first nor kept, which made a 10 MiB capture into shared memory take about 35% less
// CPU time than memcpy and leaves the cache to the training that runs beside it. Ends with a store
// fence, so a flag written after it (a slot marked finished) is seen after the bytes.
void copy_bypassing_cache(void* destination, const void* source, std::size_t bytes);

}  // namespace commsched
