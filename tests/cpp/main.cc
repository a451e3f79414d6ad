// Runs every registered C++ test case of the scheduling core.
#include "check.h"

int main() { return check::run_all(); }
