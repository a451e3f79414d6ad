#include "elementwise.h"

#include <cmath>
#include <cstring>

namespace commsched {

float half_to_float(uint16_t bits) {
  const uint32_t sign = (bits & 0x8000u) << 16;
  const uint32_t exponent = (bits >> 10) & 0x1f;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t result;
  if (exponent == 0) {
    if (mantissa == 0) {
      result = sign;
    } else {  // subnormal: normalise into a float exponent
      int shift = 0;
      while ((mantissa & 0x400u) == 0) {
        mantissa <<= 1;
        ++shift;
      }
      mantissa &= 0x3ffu;
      result = sign | static_cast<uint32_t>(127 - 15 - shift + 1) << 23 | mantissa << 13;
    }
  } else if (exponent == 0x1f) {
    result = sign | 0x7f800000u | mantissa << 13;
  } else {
    result = sign | (exponent + 127 - 15) << 23 | mantissa << 13;
  }
  float value;
  std::memcpy(&value, &result, sizeof(value));
  return value;
}

uint16_t float_to_half(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const int32_t exponent = static_cast<int32_t>((bits >> 23) & 0xff) - 127 + 15;
  uint32_t mantissa = bits & 0x7fffffu;
  if (((bits >> 23) & 0xff) == 0xff) {  // inf or nan
    return static_cast<uint16_t>(sign | 0x7c00u | (mantissa ? 0x200u : 0u));
  }
  if (exponent >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (exponent <= 0) {
    if (exponent < -10) return sign;
    mantissa |= 0x800000u;
    const int shift = 14 - exponent;
    uint32_t half_mantissa = mantissa >> shift;
    const uint32_t remainder = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (remainder > halfway || (remainder == halfway && (half_mantissa & 1u))) ++half_mantissa;
    return static_cast<uint16_t>(sign | half_mantissa);
  }
  uint32_t half = static_cast<uint32_t>(exponent) << 10 | mantissa >> 13;
  const uint32_t remainder = mantissa & 0x1fffu;
  if (remainder > 0x1000u || (remainder == 0x1000u && (half & 1u))) ++half;  // round to nearest even
  return static_cast<uint16_t>(sign | half);
}

float bfloat16_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &widened, sizeof(value));
  return value;
}

uint16_t float_to_bfloat16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  if (std::isnan(value)) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

namespace {

template <typename T>
void sum_typed(void* dst, const void* src, uint64_t count) {
  auto* out = static_cast<T*>(dst);
  const auto* in = static_cast<const T*>(src);
  for (uint64_t i = 0; i < count; ++i) out[i] = static_cast<T>(out[i] + in[i]);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void sum_packed16(void* dst, const void* src, uint64_t count) {
  auto* out = static_cast<uint16_t*>(dst);
  const auto* in = static_cast<const uint16_t*>(src);
  for (uint64_t i = 0; i < count; ++i) out[i] = FromFloat(ToFloat(out[i]) + ToFloat(in[i]));
}

template <typename T>
void divide_typed(void* data, uint64_t count, double divisor) {
  auto* values = static_cast<T*>(data);
  for (uint64_t i = 0; i < count; ++i) values[i] = static_cast<T>(values[i] / divisor);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void divide_packed16(void* data, uint64_t count, double divisor) {
  auto* values = static_cast<uint16_t*>(data);
  const float factor = static_cast<float>(divisor);
  for (uint64_t i = 0; i < count; ++i) values[i] = FromFloat(ToFloat(values[i]) / factor);
}

}  // namespace

void sum_into(void* dst, const void* src, uint64_t count, DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return sum_packed16<half_to_float, float_to_half>(dst, src, count);
    case DType::kBFloat16: return sum_packed16<bfloat16_to_float, float_to_bfloat16>(dst, src, count);
    case DType::kFloat32: return sum_typed<float>(dst, src, count);
    case DType::kFloat64: return sum_typed<double>(dst, src, count);
    case DType::kInt32: return sum_typed<int32_t>(dst, src, count);
    case DType::kInt64: return sum_typed<int64_t>(dst, src, count);
    case DType::kUInt8: return sum_typed<uint8_t>(dst, src, count);
    case DType::kInt8: return sum_typed<int8_t>(dst, src, count);
  }
}

void divide_by(void* data, uint64_t count, DType dtype, double divisor) {
  switch (dtype) {
    case DType::kFloat16: return divide_packed16<half_to_float, float_to_half>(data, count, divisor);
    case DType::kBFloat16: return divide_packed16<bfloat16_to_float, float_to_bfloat16>(data, count, divisor);
    case DType::kFloat32: return divide_typed<float>(data, count, divisor);
    case DType::kFloat64: return divide_typed<double>(data, count, divisor);
    default:
      throw UsageError(std::string("op=\"average\" needs a floating dtype, not ") + dtype_name(dtype) +
                       "; use op=\"sum\" for integers");
  }
}

}  // namespace commsched
