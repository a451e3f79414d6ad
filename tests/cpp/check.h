// A minimal test harness for the core's C++ tests: no dependency beyond the standard library.
#pragma once

#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace check {

struct Case {
  const char* name;
  std::function<void()> body;
};

inline std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

struct Failure {
  std::string message;
};

struct Registrar {
  Registrar(const char* name, std::function<void()> body) { registry().push_back({name, std::move(body)}); }
};

inline int run_all() {
  int failed = 0;
  for (const Case& test_case : registry()) {
    try {
      test_case.body();
      std::printf("PASS %s\n", test_case.name);
    } catch (const Failure& failure) {
      ++failed;
      std::printf("FAIL %s: %s\n", test_case.name, failure.message.c_str());
    } catch (const std::exception& error) {
      ++failed;
      std::printf("FAIL %s: unexpected exception: %s\n", test_case.name, error.what());
    }
  }
  std::printf("%zu cases, %d failed\n", registry().size(), failed);
  return failed == 0 ? 0 : 1;
}

}  // namespace check

#define CHECK_CONCAT_INNER(a, b) a##b
#define CHECK_CONCAT(a, b) CHECK_CONCAT_INNER(a, b)
#define TEST_CASE(name)                                                              \
  static void name();                                                                \
  static check::Registrar CHECK_CONCAT(registrar_, name)(#name, name);              \
  static void name()

#define EXPECT(condition)                                                                        \
  do {                                                                                           \
    if (!(condition)) {                                                                          \
      std::ostringstream where;                                                                  \
      where << __FILE__ << ":" << __LINE__ << ": expected " #condition;                         \
      throw check::Failure{where.str()};                                                         \
    }                                                                                            \
  } while (0)

#define EXPECT_EQ(actual, expected)                                                              \
  do {                                                                                           \
    const auto& actual_value = (actual);                                                         \
    const auto& expected_value = (expected);                                                     \
    if (!(actual_value == expected_value)) {                                                     \
      std::ostringstream where;                                                                  \
      where << __FILE__ << ":" << __LINE__ << ": " #actual " is " << actual_value << ", expected " \
            << expected_value;                                                                   \
      throw check::Failure{where.str()};                                                         \
    }                                                                                            \
  } while (0)

#define EXPECT_THROWS(statement, exception_type, fragment)                                       \
  do {                                                                                           \
    bool thrown = false;                                                                         \
    try {                                                                                        \
      statement;                                                                                 \
    } catch (const exception_type& error) {                                                      \
      thrown = std::string(error.what()).find(fragment) != std::string::npos;                   \
      if (!thrown) throw check::Failure{std::string("wrong message: ") + error.what()};          \
    }                                                                                            \
    if (!thrown) throw check::Failure{std::string(__FILE__) + ": expected " #exception_type};   \
  } while (0)
