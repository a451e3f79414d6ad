#include "transport/mpi/mpi_algorithms.h"

#include <mpi.h>

#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace commsched {

namespace {

constexpr const char* kReduceScatterVariable = "MPIR_CVAR_IREDUCE_SCATTER_INTRA_ALGORITHM";

// The tool interface is reference counted: each session initialises and finalises its own use.
class ToolSession {
 public:
  ToolSession() {
    int provided = 0;
    ok_ = MPI_T_init_thread(MPI_THREAD_MULTIPLE, &provided) == MPI_SUCCESS;
  }
  ~ToolSession() {
    if (ok_) MPI_T_finalize();
  }
  ToolSession(const ToolSession&) = delete;
  ToolSession& operator=(const ToolSession&) = delete;
  bool ok() const { return ok_; }

 private:
  bool ok_ = false;
};

class VariableHandle {
 public:
  explicit VariableHandle(int index) {
    int count = 0;
    ok_ = MPI_T_cvar_handle_alloc(index, nullptr, &handle_, &count) == MPI_SUCCESS && count == 1;
  }
  ~VariableHandle() {
    if (handle_ != MPI_T_CVAR_HANDLE_NULL) MPI_T_cvar_handle_free(&handle_);
  }
  VariableHandle(const VariableHandle&) = delete;
  VariableHandle& operator=(const VariableHandle&) = delete;
  bool ok() const { return ok_; }
  MPI_T_cvar_handle get() const { return handle_; }

 private:
  MPI_T_cvar_handle handle_ = MPI_T_CVAR_HANDLE_NULL;
  bool ok_ = false;
};

// A control variable whose integer value picks one of named choices.
struct ChoiceVariable {
  int index = -1;
  int scope = MPI_T_SCOPE_CONSTANT;
  std::vector<std::pair<int, std::string>> choices;  // (value, name)
};

// MPICH describes its algorithm variables without an MPI_T enum: the description's first line
// says what the variable is, and each later line names the choice of value 0, 1, 2, ... first.
std::vector<std::pair<int, std::string>> choices_from_description(const std::string& description) {
  std::vector<std::pair<int, std::string>> choices;
  std::istringstream lines(description);
  std::string line;
  std::getline(lines, line);
  while (std::getline(lines, line)) {
    std::istringstream words(line);
    std::string name;
    if (words >> name) choices.emplace_back(static_cast<int>(choices.size()), name);
  }
  return choices;
}

std::vector<std::pair<int, std::string>> choices_from_enum(MPI_T_enum values) {
  std::vector<std::pair<int, std::string>> choices;
  int items = 0, length = 0;
  if (MPI_T_enum_get_info(values, &items, nullptr, &length) != MPI_SUCCESS) return choices;
  for (int item = 0; item < items; ++item) {
    char name[256];
    int name_length = sizeof(name);
    int value = 0;
    if (MPI_T_enum_get_item(values, item, &value, name, &name_length) == MPI_SUCCESS) choices.emplace_back(value, name);
  }
  return choices;
}

bool find_choice_variable(const char* name, ChoiceVariable& found) {
  if (MPI_T_cvar_get_index(name, &found.index) != MPI_SUCCESS) return false;
  MPI_Datatype type = MPI_DATATYPE_NULL;
  MPI_T_enum values = MPI_T_ENUM_NULL;
  int verbosity = 0, bind = 0;
  std::string description(8192, '\0');  // MPI truncates a longer one to fit
  int description_length = static_cast<int>(description.size());
  if (MPI_T_cvar_get_info(found.index, nullptr, nullptr, &verbosity, &type, &values, description.data(),
                          &description_length, &bind, &found.scope) != MPI_SUCCESS ||
      type != MPI_INT) {
    return false;
  }
  description.resize(std::strlen(description.c_str()));
  found.choices = values != MPI_T_ENUM_NULL ? choices_from_enum(values) : choices_from_description(description);
  return !found.choices.empty();
}

std::string name_of(const ChoiceVariable& variable, int value) {
  for (const auto& [choice, name] : variable.choices) {
    if (choice == value) return name;
  }
  return std::to_string(value);
}

bool value_named(const ChoiceVariable& variable, const std::string& wanted, int& value) {
  for (const auto& [choice, name] : variable.choices) {
    if (name == wanted) {
      value = choice;
      return true;
    }
  }
  return false;
}

std::string current_name(const ChoiceVariable& variable, const VariableHandle& handle) {
  int value = 0;
  if (MPI_T_cvar_read(handle.get(), &value) != MPI_SUCCESS) return {};
  return name_of(variable, value);
}

}  // namespace

std::string reduce_scatter_algorithm() {
  ToolSession session;
  ChoiceVariable variable;
  if (!session.ok() || !find_choice_variable(kReduceScatterVariable, variable)) return {};
  VariableHandle handle(variable.index);
  return handle.ok() ? current_name(variable, handle) : std::string();
}

std::string prefer_pairwise_reduce_scatter() {
  ToolSession session;
  ChoiceVariable variable;
  if (!session.ok() || !find_choice_variable(kReduceScatterVariable, variable)) return {};
  VariableHandle handle(variable.index);
  if (!handle.ok()) return {};
  const std::string current = current_name(variable, handle);
  // "auto" is MPICH's default: its selection file picks recursive halving below 512 KiB.
  const bool user_chose = std::getenv(kReduceScatterVariable) != nullptr || current != "auto";
  const bool writable = variable.scope != MPI_T_SCOPE_CONSTANT && variable.scope != MPI_T_SCOPE_READONLY;
  int pairwise = 0;
  if (user_chose || !writable || !value_named(variable, "sched_pairwise", pairwise)) return current;
  if (MPI_T_cvar_write(handle.get(), &pairwise) != MPI_SUCCESS) return current;
  return current_name(variable, handle);
}

}  // namespace commsched
