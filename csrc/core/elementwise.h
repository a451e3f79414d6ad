// Element-wise kernels the core needs around a collective: scaling for op="average"
// and summation for transports whose library lacks half-precision reductions.
#pragma once

#include <cstdint>

#include "types.h"

namespace commsched {

float half_to_float(uint16_t bits);
uint16_t float_to_half(float value);
float bfloat16_to_float(uint16_t bits);
uint16_t float_to_bfloat16(float value);

// dst[i] += src[i] for `count` elements of `dtype`.
void sum_into(void* dst, const void* src, uint64_t count, DType dtype);

// data[i] /= divisor for `count` elements of a floating `dtype`.
void divide_by(void* data, uint64_t count, DType dtype, double divisor);

}  // namespace commsched
