/* A stand-in for a CUDA-aware MPI's extension query, LD_PRELOADed into ranks by tests: answers
 * FAKE_MPIX_CUDA (default 1), so code that asks whether MPI can move GPU buffers can be tested both ways. */
#include <stdlib.h>

int MPIX_Query_cuda_support(void) {
  const char* answer = getenv("FAKE_MPIX_CUDA");
  return answer != NULL && *answer != '\0' ? atoi(answer) : 1;
}
