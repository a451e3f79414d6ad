// Checkpoint captures' host copies: every byte lands, whatever the alignment and length.
#include <cstdint>
#include <vector>

#include "check.h"
#include "core/host_copy.h"

using namespace commsched;

namespace {

std::vector<unsigned char> pattern(std::size_t bytes) {
  std::vector<unsigned char> data(bytes);
  for (std::size_t i = 0; i < bytes; ++i) data[i] = static_cast<unsigned char>((i * 131 + 7) % 251);
  return data;
}

}  // namespace

TEST_CASE(copy_bypassing_cache_copies_every_byte_at_any_alignment) {
  // Lengths on both sides of the streaming threshold, with tails that are not whole cache lines.
  const std::size_t lengths[] = {0, 1, 63, kStreamingCopyMinBytes - 1, kStreamingCopyMinBytes,
                                 kStreamingCopyMinBytes + 77, 3 * kStreamingCopyMinBytes + 5};
  for (std::size_t length : lengths) {
    for (std::size_t source_offset : {0, 1, 8, 15}) {
      for (std::size_t destination_offset : {0, 3, 16, 17}) {
        const std::vector<unsigned char> source = pattern(length + source_offset);
        std::vector<unsigned char> destination(length + destination_offset + 32, 0xEE);
        copy_bypassing_cache(destination.data() + destination_offset, source.data() + source_offset, length);
        bool same = true;
        for (std::size_t i = 0; i < length; ++i) {
          same = same && destination[destination_offset + i] == source[source_offset + i];
        }
        EXPECT(same);
        // Nothing before or after the destination range is written.
        for (std::size_t i = 0; i < destination_offset; ++i) EXPECT_EQ(destination[i], 0xEE);
        for (std::size_t i = destination_offset + length; i < destination.size(); ++i) EXPECT_EQ(destination[i], 0xEE);
      }
    }
  }
}
