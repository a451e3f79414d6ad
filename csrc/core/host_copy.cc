#include "core/host_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define COMMSCHED_STREAMING_STORES 1
#endif

namespace commsched {

void copy_bypassing_cache(void* destination, const void* source, std::size_t bytes) {
  if (bytes == 0) return;  // memcpy's addresses must not be null even for no bytes
#ifdef COMMSCHED_STREAMING_STORES
  if (bytes >= kStreamingCopyMinBytes) {
    auto* to = static_cast<unsigned char*>(destination);
    const auto* from = static_cast<const unsigned char*>(source);
    // Streaming stores need a 16-byte aligned destination: the bytes before it go through memcpy.
    const std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(to) & 15)) & 15;
    std::memcpy(to, from, head);
    to += head;
    from += head;
    bytes -= head;
    const std::size_t lines = bytes / 64;
    for (std::size_t i = 0; i < lines; ++i, to += 64, from += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(from + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(to), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(to + 48), d);
    }
    std::memcpy(to, from, bytes - lines * 64);
    _mm_sfence();  // streaming stores are weakly ordered: make them visible before later stores
    return;
  }
#endif
  std::memcpy(destination, source, bytes);
}

}  // namespace commsched
