/* Shared by the fake CUDA runtime (fake_cuda.c) and the fake NCCL (fake_nccl*.c), which build into one
 * library for tests on machines without a GPU. "Device" memory is host memory, every stream is a worker
 * thread with a FIFO of operations, and NCCL reduces across real processes through POSIX shared memory,
 * so an operation ordered wrongly reads or writes the wrong numbers. */
#pragma once

#include <stddef.h>
#include <stdint.h>

/* Internal to the library: only the CUDA, NCCL and fake_* test entry points are exported. */
#pragma GCC visibility push(hidden)

/* One unit of stream work: run() executes it on the stream's worker thread and frees it. */
typedef struct fake_op {
  void (*run)(struct fake_op* op);
  struct fake_op* next;
} fake_op;

/* cudaError_t values the fake returns. */
enum {
  kCudaSuccess = 0,
  kCudaErrorInvalidValue = 1,
  kCudaErrorMemoryAllocation = 2,
  kCudaErrorNoDevice = 100,
  kCudaErrorInvalidDevice = 101,
  kCudaErrorInvalidResourceHandle = 400,
  kCudaErrorNotReady = 600,
};

/* Queues op on the stream named by handle (made by cudaStreamCreate*, a user's handle, 0/1 for the legacy
 * default stream, 2 for this thread's per-thread default stream); takes op; returns a cudaError_t. */
int fake_stream_enqueue(void* stream, fake_op* op);
/* How the call log names a stream: "own" (or "own2", ...) for streams the fake made, else "0x..". */
void fake_stream_name(void* stream, char out[32]);
/* Appends one entry to the call log. */
void fake_note(const char* format, ...) __attribute__((format(printf, 1, 2)));
/* "main" on the thread that called fake_set_main_thread(), "other" elsewhere. */
const char* fake_who(void);
/* The calling thread's current CUDA device. */
int fake_device(void);

double fake_now(void); /* monotonic seconds */
void fake_sleep_us(unsigned microseconds);
/* A number from the environment, or fallback when unset or not a number. */
double fake_env_number(const char* name, double fallback);
/* Blocks while *word == expected for at most timeout_us (a futex, so it works across processes on shared
 * memory); may return early, callers re-check. */
void fake_wait_word(uint32_t* word, uint32_t expected, unsigned timeout_us);
void fake_wake_word(uint32_t* word);
/* Waits until every stream finished what was queued on it at the call (real cudaFree synchronizes). */
void fake_drain_all_streams(void);

#pragma GCC visibility pop
