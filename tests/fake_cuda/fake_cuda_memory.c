/* The fake CUDA runtime's memory and work: host memory as device memory, copies and host functions as
 * stream operations, and fake_launch_write(), a stand-in for a producer kernel that finishes late. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "fake_cuda.h"

typedef struct {
  fake_op base;
  void* target;
  const void* source;
  size_t bytes;
  unsigned delay_us; /* slept first, on top of the per-operation delay */
  void (*host_function)(void*);
  void* user_data;
  char snapshot[]; /* fake_launch_write's source, taken at launch */
} work_op;

static void run_work(fake_op* base) {
  work_op* op = (work_op*)base;
  if (op->delay_us > 0) fake_sleep_us(op->delay_us);
  if (op->host_function != NULL)
    op->host_function(op->user_data);
  else if (op->bytes > 0)
    memmove(op->target, op->source, op->bytes);
  free(op);
}

static int enqueue_work(void* stream, work_op prototype) {
  work_op* op = malloc(sizeof *op);
  if (op == NULL) return kCudaErrorMemoryAllocation;
  *op = prototype;
  op->base.run = run_work;
  return fake_stream_enqueue(stream, &op->base);
}

int cudaMemcpyAsync(void* target, const void* source, size_t bytes, int kind, void* stream) {
  char name[32];
  fake_stream_name(stream, name);
  fake_note("memcpy %zu kind %d on %s", bytes, kind, name);
  if (bytes > 0 && (target == NULL || source == NULL)) return kCudaErrorInvalidValue;
  return enqueue_work(stream, (work_op){.target = target, .source = source, .bytes = bytes});
}

int cudaMemcpy(void* target, const void* source, size_t bytes, int kind) {
  fake_note("memcpy %zu kind %d blocking", bytes, kind);
  if (bytes > 0 && (target == NULL || source == NULL)) return kCudaErrorInvalidValue;
  if (bytes > 0) memmove(target, source, bytes);
  return kCudaSuccess;
}

int cudaMalloc(void** out, size_t bytes) {
  fake_note("malloc %zu", bytes);
  if (out == NULL) return kCudaErrorInvalidValue;
  size_t rounded = bytes == 0 ? 64 : (bytes + 63) / 64 * 64;
  if (posix_memalign(out, 64, rounded) != 0) {
    *out = NULL;
    return kCudaErrorMemoryAllocation;
  }
  memset(*out, 0xff, rounded); /* NaN for floats, -1 for integers: a read before any write shows */
  return kCudaSuccess;
}

int cudaFree(void* pointer) {
  fake_note("free");
  fake_drain_all_streams();
  free(pointer);
  return kCudaSuccess;
}

int cudaLaunchHostFunc(void* stream, void (*function)(void*), void* user_data) {
  char name[32];
  fake_stream_name(stream, name);
  fake_note("hostfunc on %s", name);
  if (function == NULL) return kCudaErrorInvalidValue;
  return enqueue_work(stream, (work_op){.host_function = function, .user_data = user_data});
}

/* A test's producer kernel: on stream, sleeps delay_us, then writes to target the bytes source held at
 * launch (copied now, like a kernel's arguments, so the caller may free source at once). */
int fake_launch_write(void* stream, void* target, const void* source, size_t bytes, unsigned delay_us) {
  char name[32];
  fake_stream_name(stream, name);
  fake_note("write %zu on %s", bytes, name);
  if (bytes > 0 && (target == NULL || source == NULL)) return kCudaErrorInvalidValue;
  work_op* op = malloc(sizeof *op + bytes);
  if (op == NULL) return kCudaErrorMemoryAllocation;
  *op = (work_op){.base.run = run_work, .target = target, .bytes = bytes, .delay_us = delay_us};
  memcpy(op->snapshot, source, bytes);
  op->source = op->snapshot;
  return fake_stream_enqueue(stream, &op->base);
}
