#include "elementwise.h"

#include <cmath>
#include <cstring>
#include <type_traits>

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

struct Add {
  template <typename T>
  T operator()(T a, T b) const { return static_cast<T>(a + b); }
};
struct Min {
  template <typename T>
  T operator()(T a, T b) const { return b < a ? b : a; }
};
struct Max {
  template <typename T>
  T operator()(T a, T b) const { return a < b ? b : a; }
};
struct Multiply {
  template <typename T>
  T operator()(T a, T b) const { return static_cast<T>(a * b); }
};

template <typename T, typename Op>
void combine_typed(void* dst, const void* src, uint64_t count, Op op) {
  auto* out = static_cast<T*>(dst);
  const auto* in = static_cast<const T*>(src);
  for (uint64_t i = 0; i < count; ++i) out[i] = op(out[i], in[i]);
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float), typename Op>
void combine_packed16(void* dst, const void* src, uint64_t count, Op op) {
  auto* out = static_cast<uint16_t*>(dst);
  const auto* in = static_cast<const uint16_t*>(src);
  for (uint64_t i = 0; i < count; ++i) out[i] = FromFloat(op(ToFloat(out[i]), ToFloat(in[i])));
}

template <typename Op>
void combine(void* dst, const void* src, uint64_t count, DType dtype, Op op) {
  switch (dtype) {
    case DType::kFloat16: return combine_packed16<half_to_float, float_to_half>(dst, src, count, op);
    case DType::kBFloat16: return combine_packed16<bfloat16_to_float, float_to_bfloat16>(dst, src, count, op);
    case DType::kFloat32: return combine_typed<float>(dst, src, count, op);
    case DType::kFloat64: return combine_typed<double>(dst, src, count, op);
    case DType::kInt32: return combine_typed<int32_t>(dst, src, count, op);
    case DType::kInt64: return combine_typed<int64_t>(dst, src, count, op);
    case DType::kUInt8: return combine_typed<uint8_t>(dst, src, count, op);
    case DType::kInt8: return combine_typed<int8_t>(dst, src, count, op);
    case DType::kInt16: return combine_typed<int16_t>(dst, src, count, op);
    case DType::kBool: return combine_typed<uint8_t>(dst, src, count, op);  // 0/1 bytes: min = and, max = or
  }
}

// Integers wrap as in MPI: the sum is taken in the unsigned type of the same width.
template <typename T>
void sum_integers(void* dst, const void* src, uint64_t count) {
  using Unsigned = std::make_unsigned_t<T>;
  auto* out = static_cast<T*>(dst);
  const auto* in = static_cast<const T*>(src);
  for (uint64_t i = 0; i < count; ++i) {
    out[i] = static_cast<T>(static_cast<Unsigned>(static_cast<Unsigned>(out[i]) + static_cast<Unsigned>(in[i])));
  }
}

template <typename T>
void divide_typed(void* data, uint64_t count, double divisor) {
  auto* values = static_cast<T*>(data);
  for (uint64_t i = 0; i < count; ++i) values[i] = static_cast<T>(values[i] / divisor);
}

template <typename T>
void floor_divide_typed(void* data, uint64_t count, double divisor) {
  auto* values = static_cast<T*>(data);
  const auto by = static_cast<int64_t>(divisor);
  for (uint64_t i = 0; i < count; ++i) {
    const int64_t value = static_cast<int64_t>(values[i]);
    int64_t quotient = value / by;
    if ((value % by != 0) && ((value < 0) != (by < 0))) --quotient;
    values[i] = static_cast<T>(quotient);
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void divide_packed16(void* data, uint64_t count, double divisor) {
  auto* values = static_cast<uint16_t*>(data);
  const float factor = static_cast<float>(divisor);
  for (uint64_t i = 0; i < count; ++i) values[i] = FromFloat(ToFloat(values[i]) / factor);
}

template <typename T>
void multiply_typed(void* data, uint64_t count, double factor) {
  auto* values = static_cast<T*>(data);
  if constexpr (std::is_same_v<T, float>) {
    // float32 data times a float32 factor, as Horovod and the frameworks scale: the results match bit for bit.
    const float by = static_cast<float>(factor);
    for (uint64_t i = 0; i < count; ++i) values[i] *= by;
  } else {
    for (uint64_t i = 0; i < count; ++i) values[i] = static_cast<T>(static_cast<double>(values[i]) * factor);
  }
}

template <float (*ToFloat)(uint16_t), uint16_t (*FromFloat)(float)>
void multiply_packed16(void* data, uint64_t count, double factor) {
  auto* values = static_cast<uint16_t*>(data);
  const float by = static_cast<float>(factor);
  for (uint64_t i = 0; i < count; ++i) values[i] = FromFloat(ToFloat(values[i]) * by);
}

}  // namespace

void sum_into(void* dst, const void* src, uint64_t count, DType dtype) {
  reduce_into(dst, src, count, dtype, ReduceOp::kSum);
}

void reduce_into(void* dst, const void* src, uint64_t count, DType dtype, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAverage:
      switch (dtype) {
        case DType::kInt32: return sum_integers<int32_t>(dst, src, count);
        case DType::kInt64: return sum_integers<int64_t>(dst, src, count);
        case DType::kInt16: return sum_integers<int16_t>(dst, src, count);
        case DType::kInt8: return sum_integers<int8_t>(dst, src, count);
        case DType::kBool:
          throw UsageError("op=\"sum\" is not defined for bool; use op=\"max\" (logical or) or \"min\" (logical and)");
        default: return combine(dst, src, count, dtype, Add{});
      }
    case ReduceOp::kMin: return combine(dst, src, count, dtype, Min{});
    case ReduceOp::kMax: return combine(dst, src, count, dtype, Max{});
    case ReduceOp::kProduct:
      if (dtype == DType::kBool) return combine(dst, src, count, dtype, Min{});  // and
      return combine(dst, src, count, dtype, Multiply{});
  }
}

void divide_by(void* data, uint64_t count, DType dtype, double divisor) {
  switch (dtype) {
    case DType::kFloat16: return divide_packed16<half_to_float, float_to_half>(data, count, divisor);
    case DType::kBFloat16: return divide_packed16<bfloat16_to_float, float_to_bfloat16>(data, count, divisor);
    case DType::kFloat32: return divide_typed<float>(data, count, divisor);
    case DType::kFloat64: return divide_typed<double>(data, count, divisor);
    case DType::kInt32: return floor_divide_typed<int32_t>(data, count, divisor);
    case DType::kInt64: return floor_divide_typed<int64_t>(data, count, divisor);
    case DType::kInt16: return floor_divide_typed<int16_t>(data, count, divisor);
    case DType::kInt8: return floor_divide_typed<int8_t>(data, count, divisor);
    case DType::kUInt8: return floor_divide_typed<uint8_t>(data, count, divisor);
    case DType::kBool: break;
  }
  throw UsageError("op=\"average\" is not defined for bool; use op=\"min\" or op=\"max\"");
}

void multiply_by(void* data, uint64_t count, DType dtype, double factor) {
  switch (dtype) {
    case DType::kFloat16: return multiply_packed16<half_to_float, float_to_half>(data, count, factor);
    case DType::kBFloat16: return multiply_packed16<bfloat16_to_float, float_to_bfloat16>(data, count, factor);
    case DType::kFloat32: return multiply_typed<float>(data, count, factor);
    case DType::kFloat64: return multiply_typed<double>(data, count, factor);
    case DType::kInt32: return multiply_typed<int32_t>(data, count, factor);
    case DType::kInt64: return multiply_typed<int64_t>(data, count, factor);
    case DType::kInt16: return multiply_typed<int16_t>(data, count, factor);
    case DType::kInt8: return multiply_typed<int8_t>(data, count, factor);
    case DType::kUInt8: return multiply_typed<uint8_t>(data, count, factor);
    case DType::kBool: break;
  }
  throw UsageError("scale factors are not defined for bool; leave prescale_factor and postscale_factor at 1");
}

}  // namespace commsched
