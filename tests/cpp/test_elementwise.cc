// Half-precision conversions and the kernels used for "average" and MPI's 16-bit sums.
#include <cmath>
#include <vector>

#include "check.h"
#include "core/elementwise.h"

using namespace commsched;

TEST_CASE(half_round_trips_exact_values) {
  const float values[] = {0.0f, 1.0f, -2.5f, 65504.0f, 0.000061035156f, 1000.5f, -0.1875f};
  for (float value : values) EXPECT_EQ(half_to_float(float_to_half(value)), value);
  EXPECT(std::isinf(half_to_float(float_to_half(1e6f))));
  EXPECT(std::isnan(half_to_float(float_to_half(NAN))));
  // Subnormal: 2^-24 is the smallest positive half.
  EXPECT_EQ(half_to_float(float_to_half(5.9604645e-8f)), 5.9604645e-8f);
}

TEST_CASE(half_rounds_to_nearest_even) {
  // 2049 lies halfway between 2048 and 2050 in half precision.
  EXPECT_EQ(half_to_float(float_to_half(2049.0f)), 2048.0f);
  EXPECT_EQ(half_to_float(float_to_half(2051.0f)), 2052.0f);
}

TEST_CASE(bfloat16_round_trips_and_rounds) {
  EXPECT_EQ(bfloat16_to_float(float_to_bfloat16(1.5f)), 1.5f);
  EXPECT_EQ(bfloat16_to_float(float_to_bfloat16(-384.0f)), -384.0f);
  EXPECT_EQ(bfloat16_to_float(float_to_bfloat16(1.00390625f)), 1.0f);  // halfway rounds to even
}

TEST_CASE(sum_into_adds_each_dtype) {
  std::vector<uint16_t> a = {float_to_half(1.5f), float_to_half(-2.0f)};
  std::vector<uint16_t> b = {float_to_half(0.25f), float_to_half(3.0f)};
  sum_into(a.data(), b.data(), 2, DType::kFloat16);
  EXPECT_EQ(half_to_float(a[0]), 1.75f);
  EXPECT_EQ(half_to_float(a[1]), 1.0f);
  std::vector<int64_t> x = {1, -5};
  std::vector<int64_t> y = {10, 5};
  sum_into(x.data(), y.data(), 2, DType::kInt64);
  EXPECT_EQ(x[0], 11);
  EXPECT_EQ(x[1], 0);
}

TEST_CASE(divide_by_averages_floats_floor_divides_integers_and_refuses_bools) {
  std::vector<double> values = {3.0, 9.0};
  divide_by(values.data(), 2, DType::kFloat64, 3.0);
  EXPECT_EQ(values[0], 1.0);
  EXPECT_EQ(values[1], 3.0);
  std::vector<uint16_t> halves = {float_to_bfloat16(6.0f)};
  divide_by(halves.data(), 1, DType::kBFloat16, 4.0);
  EXPECT_EQ(bfloat16_to_float(halves[0]), 1.5f);
  std::vector<int32_t> ints = {5, -5};
  divide_by(ints.data(), 2, DType::kInt32, 2.0);
  EXPECT_EQ(ints[0], 2);
  EXPECT_EQ(ints[1], -3);
  std::vector<uint8_t> bools = {1};
  EXPECT_THROWS(divide_by(bools.data(), 1, DType::kBool, 2.0), UsageError, "not defined for bool");
}

