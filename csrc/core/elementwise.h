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

// dst[i] = op(dst[i], src[i]): sum (average sums too), min, max or product. Half types compute in
// float and round to nearest even; integers wrap; bool: min and product are "and", max is "or".
// Throws UsageError for a sum of bools.
void reduce_into(void* dst, const void* src, uint64_t count, DType dtype, ReduceOp op);

// data[i] /= divisor for `count` elements; integers are floor-divided (as Horovod averages them).
void divide_by(void* data, uint64_t count, DType dtype, double divisor);

// data[i] *= factor for `count` elements (prescale / postscale factors); integers are multiplied in
// double precision and truncated toward zero, as Horovod scales them.
void multiply_by(void* data, uint64_t count, DType dtype, double factor);

}  // namespace commsched
