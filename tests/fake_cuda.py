"""A fake libnccl + libcudart compiled on the host, for testing the NCCL transport without a GPU.

"Device" memory is host memory. Every call is logged (`calls()`), events are numbered so a wait
can be matched with the record that made it, and calls made on another thread than the one that
called `fake_set_main_thread()` are tagged "other". The fake allreduce acts as if a second rank held
identical float32 data: a sum doubles it, ncclAvg leaves it, so the two are told apart on one rank.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import numpy as np

FAKE_SOURCE = r"""
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
static char calls[16384];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_t main_thread;
static uintptr_t next_event;
static __thread int current_device;
static int stream_object;
static void note(const char* what) {
  pthread_mutex_lock(&lock);
  strncat(calls, what, sizeof(calls) - strlen(calls) - 2); strcat(calls, ";");
  pthread_mutex_unlock(&lock);
}
static const char* who(void) { return pthread_equal(pthread_self(), main_thread) ? "main" : "other"; }
static void stream_name(void* s, char* out) {
  if (s == &stream_object) strcpy(out, "own"); else snprintf(out, 32, "0x%lx", (unsigned long)(uintptr_t)s);
}
const char* fake_calls(void) { return calls; }
void fake_reset(void) { pthread_mutex_lock(&lock); calls[0] = 0; next_event = 0; pthread_mutex_unlock(&lock); }
void fake_set_main_thread(void) { main_thread = pthread_self(); }
int fake_current_device(void) { return current_device; }
typedef struct { char internal[128]; } ncclUniqueId;
int ncclGetVersion(int* v) { const char* e = getenv("FAKE_NCCL_VERSION"); *v = e ? atoi(e) : 22105; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) { memset(id->internal, 7, 128); note("uniqueid"); return 0; }
int ncclCommInitRank(void** comm, int size, ncclUniqueId id, int rank) {
  char b[64]; snprintf(b, 64, "init on device %d", current_device);
  *comm = (void*)calls; note(id.internal[5] == 7 && size == 1 && rank == 0 ? b : "init-bad-args"); return 0; }
int ncclCommDestroy(void* c) { note("destroy"); return 0; }
int ncclCommAbort(void* c) { note("abort"); return 0; }
int ncclCommGetAsyncError(void* c, int* e) { *e = 0; return 0; }
int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, void* c, void* st) {
  char b[96]; snprintf(b, 96, "allreduce %zu type %d op %d %s", n, t, op, who()); note(b);
  if (t == 7 && op == 0) for (size_t i = 0; i < n; ++i) ((float*)r)[i] *= 2;  /* two identical ranks */
  return s == r ? 0 : 5; }
int ncclBroadcast(const void* s, void* r, size_t n, int t, int root, void* c, void* st) {
  char b[64]; snprintf(b, 64, "broadcast %zu root %d", n, root); note(b); return 0; }
const char* ncclGetErrorString(int e) { return "fake nccl error"; }
int cudaGetDeviceCount(int* n) { *n = 2; return 0; }
int cudaSetDevice(int d) { char b[32]; snprintf(b, 32, "setdevice %d", d); note(b); current_device = d; return 0; }
int cudaGetDevice(int* d) { *d = current_device; return 0; }
int cudaStreamCreateWithFlags(void** s, unsigned f) { *s = &stream_object; return 0; }
int cudaStreamDestroy(void* s) { return 0; }
int cudaStreamSynchronize(void* s) { char b[32]; stream_name(s, b); char c[48]; snprintf(c, 48, "sync %s", b); note(c); return 0; }
int cudaStreamWaitEvent(void* s, void* e, unsigned f) {
  char b[32]; stream_name(s, b); char c[96]; snprintf(c, 96, "wait %s ev%lu", b, (unsigned long)(uintptr_t)e); note(c); return 0; }
int cudaEventCreateWithFlags(void** e, unsigned f) {
  pthread_mutex_lock(&lock); *e = (void*)++next_event; pthread_mutex_unlock(&lock); return 0; }
int cudaEventRecord(void* e, void* s) {
  char b[32]; stream_name(s, b); char c[128];
  snprintf(c, 128, "record ev%lu on %s %s device %d", (unsigned long)(uintptr_t)e, b, who(), current_device);
  note(c); return 0; }
int cudaEventQuery(void* e) { return 0; }
int cudaEventDestroy(void* e) { return 0; }
int cudaMemcpyAsync(void* d, const void* s, size_t n, int kind, void* st) {
  char b[32]; stream_name(st, b); char c[64]; snprintf(c, 64, "memcpy %zu kind %d on %s", n, kind, b); note(c);
  memcpy(d, s, n); return 0; }
const char* cudaGetErrorString(int e) { return "fake cuda error"; }
"""


def build(folder: Path) -> Path | None:
    """Compiles the fake into folder/libfake.so; None without a C compiler."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    (folder / "fake.c").write_text(FAKE_SOURCE)
    library = folder / "libfake.so"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-pthread", "-o", str(library), str(folder / "fake.c")], check=True
    )
    return library


def calls(handle: ctypes.CDLL) -> list[str]:
    """What the fake library was asked to do, in order."""
    handle.fake_calls.restype = ctypes.c_char_p
    return [c for c in handle.fake_calls().decode().split(";") if c]


class FakeCudaArray:
    """Host memory (a numpy array) that presents itself as a CUDA array, __cuda_array_interface__ v3."""

    def __init__(self, host: np.ndarray, stream: int | None = 0xABC, device_id: int | None = None) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "data": (host.ctypes.data, False),
            "shape": host.shape,
            "typestr": host.dtype.str,
            "strides": None,
            "version": 3,
            "stream": stream,
        }
        if device_id is not None:
            self.device = type("Device", (), {"id": device_id})()
