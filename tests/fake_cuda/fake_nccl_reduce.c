/* Element-wise reductions of the fake NCCL. Integers wrap; float16 and bfloat16 compute in float and round
 * to nearest even after every step, as numpy's float16 (and ml_dtypes' bfloat16) arithmetic does. */
#include <string.h>

#include "fake_nccl.h"

static float half_to_float(uint16_t half) {
  uint32_t sign = (uint32_t)(half & 0x8000u) << 16, exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    float magnitude = (float)mantissa * 0x1p-24f; /* zero or subnormal, exact */
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31)
    bits = sign | 0x7f800000u | (mantissa << 13);
  else
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

static uint16_t float_to_half(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
  uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return sign | 0x7e00u;   /* NaN */
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;  /* 65520 and up round to infinity */
  if (magnitude <= 0x33000000u) return sign;            /* 2^-25 and below round to zero */
  uint32_t exponent = magnitude >> 23, mantissa = magnitude & 0x7fffffu, result, rest, half_way;
  if (magnitude < 0x38800000u) { /* a half subnormal: units of 2^-24 */
    uint32_t shift = 126 - exponent, full = mantissa | 0x800000u;
    result = full >> shift;
    rest = full & ((1u << shift) - 1);
    half_way = 1u << (shift - 1);
  } else {
    result = ((exponent - 112) << 10) | (mantissa >> 13);
    rest = mantissa & 0x1fffu;
    half_way = 0x1000u;
  }
  if (rest > half_way || (rest == half_way && (result & 1u))) ++result; /* a carry moves the exponent up */
  return sign | (uint16_t)result;
}

static float bfloat16_to_float(uint16_t bfloat) {
  uint32_t bits = (uint32_t)bfloat << 16;
  float value;
  memcpy(&value, &bits, sizeof value);
  return value;
}

static uint16_t float_to_bfloat16(float value) {
  uint32_t bits;
  memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u); /* quiet NaN */
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

size_t fake_dtype_bytes(int dtype) {
  static const size_t sizes[kDtypeCount] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
  return dtype >= 0 && dtype < kDtypeCount ? sizes[dtype] : 0;
}

/* Wrapping arithmetic through the unsigned type U; comparisons in T. */
#define REDUCE_INTEGER(T, U)                                                                          \
  do {                                                                                                \
    T* o = out;                                                                                       \
    const T* v = in;                                                                                  \
    for (size_t i = 0; i < count; ++i) {                                                              \
      U a = (U)o[i], b = (U)v[i];                                                                     \
      o[i] = op == kProd ? (T)(U)(a * b)                                                              \
             : op == kMax ? (v[i] > o[i] ? v[i] : o[i])                                               \
             : op == kMin ? (v[i] < o[i] ? v[i] : o[i])                                               \
                          : (T)(U)(a + b);                                                            \
    }                                                                                                 \
  } while (0)

#define REDUCE_FLOAT(T)                                                                               \
  do {                                                                                                \
    T* o = out;                                                                                       \
    const T* v = in;                                                                                  \
    for (size_t i = 0; i < count; ++i)                                                                \
      o[i] = op == kProd ? o[i] * v[i]                                                                \
             : op == kMax ? (v[i] > o[i] ? v[i] : o[i])                                               \
             : op == kMin ? (v[i] < o[i] ? v[i] : o[i])                                               \
                          : o[i] + v[i];                                                              \
  } while (0)

/* 16-bit floats: max and min keep the winner's bits, sum and product round once per step. */
#define REDUCE_SHORT_FLOAT(TO_FLOAT, FROM_FLOAT)                                                      \
  do {                                                                                                \
    uint16_t* o = out;                                                                                \
    const uint16_t* v = in;                                                                           \
    for (size_t i = 0; i < count; ++i) {                                                              \
      float a = TO_FLOAT(o[i]), b = TO_FLOAT(v[i]);                                                   \
      if (op == kMax)                                                                                 \
        o[i] = b > a ? v[i] : o[i];                                                                   \
      else if (op == kMin)                                                                            \
        o[i] = b < a ? v[i] : o[i];                                                                   \
      else                                                                                            \
        o[i] = FROM_FLOAT(op == kProd ? a * b : a + b);                                               \
    }                                                                                                 \
  } while (0)

void fake_reduce(void* out, const void* in, size_t count, int dtype, int op) {
  switch (dtype) {
    case kInt8: REDUCE_INTEGER(int8_t, uint8_t); break;
    case kUint8: REDUCE_INTEGER(uint8_t, uint8_t); break;
    case kInt32: REDUCE_INTEGER(int32_t, uint32_t); break;
    case kUint32: REDUCE_INTEGER(uint32_t, uint32_t); break;
    case kInt64: REDUCE_INTEGER(int64_t, uint64_t); break;
    case kUint64: REDUCE_INTEGER(uint64_t, uint64_t); break;
    case kFloat16: REDUCE_SHORT_FLOAT(half_to_float, float_to_half); break;
    case kFloat32: REDUCE_FLOAT(float); break;
    case kFloat64: REDUCE_FLOAT(double); break;
    case kBfloat16: REDUCE_SHORT_FLOAT(bfloat16_to_float, float_to_bfloat16); break;
    default: break;
  }
}

/* Integers divide truncating toward zero, floats divide in their own precision. */
#define DIVIDE(T)                                                                                     \
  do {                                                                                                \
    T* d = data;                                                                                      \
    for (size_t i = 0; i < count; ++i) d[i] = (T)(d[i] / (T)nranks);                                  \
  } while (0)

#define DIVIDE_SHORT_FLOAT(TO_FLOAT, FROM_FLOAT)                                                      \
  do {                                                                                                \
    uint16_t* d = data;                                                                               \
    for (size_t i = 0; i < count; ++i) d[i] = FROM_FLOAT(TO_FLOAT(d[i]) / (float)nranks);             \
  } while (0)

void fake_average(void* data, size_t count, int dtype, int nranks) {
  switch (dtype) {
    case kInt8: DIVIDE(int8_t); break;
    case kUint8: DIVIDE(uint8_t); break;
    case kInt32: DIVIDE(int32_t); break;
    case kUint32: DIVIDE(uint32_t); break;
    case kInt64: DIVIDE(int64_t); break;
    case kUint64: DIVIDE(uint64_t); break;
    case kFloat16: DIVIDE_SHORT_FLOAT(half_to_float, float_to_half); break;
    case kFloat32: DIVIDE(float); break;
    case kFloat64: DIVIDE(double); break;
    case kBfloat16: DIVIDE_SHORT_FLOAT(bfloat16_to_float, float_to_bfloat16); break;
    default: break;
  }
}

/* Integers wrap through the unsigned type, 16-bit floats multiply in float and round once. */
#define MULTIPLY_INTEGER(T, U)                                                                        \
  do {                                                                                                \
    T* d = data;                                                                                      \
    T factor;                                                                                         \
    memcpy(&factor, scalar, sizeof factor);                                                           \
    for (size_t i = 0; i < count; ++i) d[i] = (T)(U)((U)d[i] * (U)factor);                            \
  } while (0)

#define MULTIPLY_FLOAT(T)                                                                             \
  do {                                                                                                \
    T* d = data;                                                                                      \
    T factor;                                                                                         \
    memcpy(&factor, scalar, sizeof factor);                                                           \
    for (size_t i = 0; i < count; ++i) d[i] = d[i] * factor;                                          \
  } while (0)

#define MULTIPLY_SHORT_FLOAT(TO_FLOAT, FROM_FLOAT)                                                    \
  do {                                                                                                \
    uint16_t* d = data;                                                                               \
    uint16_t bits;                                                                                    \
    memcpy(&bits, scalar, sizeof bits);                                                               \
    float factor = TO_FLOAT(bits);                                                                    \
    for (size_t i = 0; i < count; ++i) d[i] = FROM_FLOAT(TO_FLOAT(d[i]) * factor);                    \
  } while (0)

void fake_multiply(void* data, size_t count, int dtype, const unsigned char* scalar) {
  switch (dtype) {
    case kInt8: MULTIPLY_INTEGER(int8_t, uint8_t); break;
    case kUint8: MULTIPLY_INTEGER(uint8_t, uint8_t); break;
    case kInt32: MULTIPLY_INTEGER(int32_t, uint32_t); break;
    case kUint32: MULTIPLY_INTEGER(uint32_t, uint32_t); break;
    case kInt64: MULTIPLY_INTEGER(int64_t, uint64_t); break;
    case kUint64: MULTIPLY_INTEGER(uint64_t, uint64_t); break;
    case kFloat16: MULTIPLY_SHORT_FLOAT(half_to_float, float_to_half); break;
    case kFloat32: MULTIPLY_FLOAT(float); break;
    case kFloat64: MULTIPLY_FLOAT(double); break;
    case kBfloat16: MULTIPLY_SHORT_FLOAT(bfloat16_to_float, float_to_bfloat16); break;
    default: break;
  }
}
