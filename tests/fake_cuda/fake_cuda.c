/* The fake CUDA runtime: streams that run asynchronously on worker threads, events with their CUDA
 * meaning, host memory standing in for device memory, and a call log the tests read back. */
#define _GNU_SOURCE
#include "fake_cuda.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* ---- helpers shared with the fake NCCL ---- */

double fake_now(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (double)now.tv_sec + (double)now.tv_nsec * 1e-9;
}

void fake_sleep_us(unsigned microseconds) {
  struct timespec wait = {microseconds / 1000000u, (long)(microseconds % 1000000u) * 1000L};
  while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {
  }
}

double fake_env_number(const char* name, double fallback) {
  const char* text = getenv(name);
  if (text == NULL || *text == '\0') return fallback;
  char* end = NULL;
  double value = strtod(text, &end);
  return (end != NULL && *end == '\0' && value >= 0) ? value : fallback;
}

void fake_wait_word(uint32_t* word, uint32_t expected, unsigned timeout_us) {
#ifdef __linux__
  struct timespec timeout = {timeout_us / 1000000u, (long)(timeout_us % 1000000u) * 1000L};
  syscall(SYS_futex, word, FUTEX_WAIT, expected, &timeout, NULL, 0);
#else
  if (__atomic_load_n(word, __ATOMIC_ACQUIRE) == expected) fake_sleep_us(timeout_us < 200 ? timeout_us : 200);
#endif
}

void fake_wake_word(uint32_t* word) {
#ifdef __linux__
  syscall(SYS_futex, word, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#else
  (void)word;
#endif
}

/* ---- the call log: a ring, so a long run forgets its oldest entries instead of overflowing ---- */

#define LOG_ENTRIES 32768
#define LOG_ENTRY_BYTES 160
static char log_ring[LOG_ENTRIES][LOG_ENTRY_BYTES];
static size_t log_first, log_count;
static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_t main_thread;
static int main_thread_set;
static unsigned stream_delay_us; /* slept before every stream operation */

void fake_note(const char* format, ...) {
  char entry[LOG_ENTRY_BYTES];
  va_list args;
  va_start(args, format);
  vsnprintf(entry, sizeof entry, format, args);
  va_end(args);
  pthread_mutex_lock(&log_lock);
  size_t slot = (log_first + log_count) % LOG_ENTRIES;
  if (log_count == LOG_ENTRIES)
    log_first = (log_first + 1) % LOG_ENTRIES;
  else
    ++log_count;
  memcpy(log_ring[slot], entry, sizeof entry);
  pthread_mutex_unlock(&log_lock);
}

/* The log joined with ';', valid until this thread's next call. */
const char* fake_calls(void) {
  static __thread char* joined;
  pthread_mutex_lock(&log_lock);
  char* grown = realloc(joined, log_count * LOG_ENTRY_BYTES + 1);
  if (grown == NULL) {
    pthread_mutex_unlock(&log_lock);
    return "";
  }
  joined = grown;
  size_t used = 0;
  for (size_t i = 0; i < log_count; ++i) {
    const char* entry = log_ring[(log_first + i) % LOG_ENTRIES];
    size_t length = strlen(entry);
    memcpy(joined + used, entry, length);
    used += length;
    joined[used++] = ';';
  }
  joined[used] = '\0';
  pthread_mutex_unlock(&log_lock);
  return joined;
}

static uint64_t next_event_number;
static pthread_mutex_t event_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t event_changed = PTHREAD_COND_INITIALIZER;

void fake_reset(void) {
  pthread_mutex_lock(&log_lock);
  log_first = log_count = 0;
  pthread_mutex_unlock(&log_lock);
  pthread_mutex_lock(&event_lock);
  next_event_number = 0;
  pthread_mutex_unlock(&event_lock);
}

void fake_set_main_thread(void) {
  main_thread = pthread_self();
  main_thread_set = 1;
}

const char* fake_who(void) {
  return main_thread_set && pthread_equal(pthread_self(), main_thread) ? "main" : "other";
}

void fake_set_delay_us(unsigned microseconds) { __atomic_store_n(&stream_delay_us, microseconds, __ATOMIC_RELAXED); }

__attribute__((constructor)) static void read_delay_from_environment(void) {
  stream_delay_us = (unsigned)fake_env_number("FAKE_CUDA_DELAY_US", 0);
}

/* ---- devices ---- */

static __thread int current_device;

int fake_device(void) { return current_device; }
int fake_current_device(void) { return current_device; }

static int device_count(void) { return (int)fake_env_number("FAKE_CUDA_DEVICES", 2); }

int cudaGetDeviceCount(int* count) {
  if (count == NULL) return kCudaErrorInvalidValue;
  *count = device_count();
  return *count > 0 ? kCudaSuccess : kCudaErrorNoDevice;
}

int cudaSetDevice(int device) {
  fake_note("setdevice %d", device);
  if (device < 0 || device >= device_count()) return kCudaErrorInvalidDevice;
  current_device = device;
  return kCudaSuccess;
}

int cudaGetDevice(int* device) {
  if (device == NULL) return kCudaErrorInvalidValue;
  *device = current_device;
  return kCudaSuccess;
}

const char* cudaGetErrorString(int error) {
  switch (error) {
    case kCudaSuccess: return "no error";
    case kCudaErrorInvalidValue: return "invalid argument";
    case kCudaErrorMemoryAllocation: return "out of memory";
    case kCudaErrorNoDevice: return "no CUDA-capable device is detected";
    case kCudaErrorInvalidDevice: return "invalid device ordinal";
    case kCudaErrorInvalidResourceHandle: return "invalid resource handle";
    case kCudaErrorNotReady: return "device not ready";
    default: return "unknown error";
  }
}

/* ---- streams: a worker thread and a FIFO each ---- */

typedef struct fake_stream {
  uintptr_t handle;   /* what callers pass; 0 stands for both legacy default handles 0 and 1 */
  int own_index;      /* 1, 2, ... for streams made by cudaStreamCreate*, else 0 */
  int per_thread;     /* a host thread's per-thread default stream (handle 2) */
  pthread_mutex_t lock;
  pthread_cond_t changed;
  fake_op *head, *tail;
  uint64_t enqueued, completed;
  int stopping;
  int refs; /* the registry, the worker, and whoever waits on it */
  struct fake_stream* next;
} fake_stream;

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static fake_stream* registry;
static __thread fake_stream* per_thread_stream;
static pthread_key_t per_thread_key;
static pthread_once_t per_thread_key_once = PTHREAD_ONCE_INIT;

static void stream_release(fake_stream* stream) {
  if (__atomic_sub_fetch(&stream->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
  pthread_mutex_destroy(&stream->lock);
  pthread_cond_destroy(&stream->changed);
  free(stream);
}

static void* stream_worker(void* argument) {
  fake_stream* stream = argument;
  pthread_mutex_lock(&stream->lock);
  for (;;) {
    while (stream->head == NULL && !stream->stopping) pthread_cond_wait(&stream->changed, &stream->lock);
    if (stream->head == NULL) break; /* stopping, and drained */
    fake_op* op = stream->head;
    stream->head = op->next;
    if (stream->head == NULL) stream->tail = NULL;
    pthread_mutex_unlock(&stream->lock);
    unsigned delay = __atomic_load_n(&stream_delay_us, __ATOMIC_RELAXED);
    if (delay > 0) fake_sleep_us(delay);
    op->run(op);
    pthread_mutex_lock(&stream->lock);
    ++stream->completed;
    pthread_cond_broadcast(&stream->changed);
  }
  pthread_mutex_unlock(&stream->lock);
  stream_release(stream);
  return NULL;
}

/* A registered stream with its worker running, holding one reference for the caller; call with
 * registry_lock held. Workers are detached: one still blocked at exit (a hung collective) cannot hang the
 * process, and the library is linked -z nodelete so a dlclose cannot unmap code they run. */
static fake_stream* stream_start(uintptr_t handle, int own_index, int per_thread) {
  fake_stream* stream = calloc(1, sizeof *stream);
  if (stream == NULL) return NULL;
  stream->handle = handle;
  stream->own_index = own_index;
  stream->per_thread = per_thread;
  stream->refs = 3;
  pthread_mutex_init(&stream->lock, NULL);
  pthread_cond_init(&stream->changed, NULL);
  if (own_index > 0) stream->handle = (uintptr_t)stream;
  pthread_t worker;
  if (pthread_create(&worker, NULL, stream_worker, stream) != 0) {
    pthread_mutex_destroy(&stream->lock);
    pthread_cond_destroy(&stream->changed);
    free(stream);
    return NULL;
  }
  pthread_detach(worker);
  stream->next = registry;
  registry = stream;
  return stream;
}

/* Unregisters the stream and lets its worker finish what is queued and exit. */
static void stream_retire(fake_stream* stream) {
  pthread_mutex_lock(&registry_lock);
  for (fake_stream** link = &registry; *link != NULL; link = &(*link)->next) {
    if (*link == stream) {
      *link = stream->next;
      break;
    }
  }
  pthread_mutex_unlock(&registry_lock);
  pthread_mutex_lock(&stream->lock);
  stream->stopping = 1;
  pthread_cond_broadcast(&stream->changed);
  pthread_mutex_unlock(&stream->lock);
  stream_release(stream);
}

static void per_thread_stream_exit(void* stream) { stream_retire(stream); }
static void make_per_thread_key(void) { pthread_key_create(&per_thread_key, per_thread_stream_exit); }

static uintptr_t stream_key(void* handle) { return (uintptr_t)handle == 1 ? 0 : (uintptr_t)handle; }

/* Registered stream for handle, or NULL; call with registry_lock held. */
static fake_stream* stream_find(uintptr_t key) {
  for (fake_stream* stream = registry; stream != NULL; stream = stream->next)
    if (stream->handle == key && !stream->per_thread) return stream;
  return NULL;
}

/* The stream behind handle with a reference for the caller, started on first use; NULL if out of memory. */
static fake_stream* stream_acquire(void* handle) {
  fake_stream* stream = NULL;
  if ((uintptr_t)handle == 2) {
    if (per_thread_stream == NULL) {
      pthread_once(&per_thread_key_once, make_per_thread_key);
      pthread_mutex_lock(&registry_lock);
      per_thread_stream = stream_start(2, 0, 1);
      pthread_mutex_unlock(&registry_lock);
      if (per_thread_stream == NULL) return NULL;
      stream_release(per_thread_stream); /* the registry's reference keeps it until the thread exits */
      pthread_setspecific(per_thread_key, per_thread_stream);
    }
    stream = per_thread_stream;
    __atomic_add_fetch(&stream->refs, 1, __ATOMIC_ACQ_REL);
    return stream;
  }
  pthread_mutex_lock(&registry_lock);
  stream = stream_find(stream_key(handle));
  if (stream != NULL)
    __atomic_add_fetch(&stream->refs, 1, __ATOMIC_ACQ_REL);
  else
    stream = stream_start(stream_key(handle), 0, 0);
  pthread_mutex_unlock(&registry_lock);
  return stream;
}

/* A forked child has none of the parent's worker threads: it forgets the parent's streams (leaked), so
 * its first use of any handle starts a fresh worker instead of queueing work nobody runs. */
static void before_fork(void) {
  pthread_mutex_lock(&registry_lock);
  pthread_mutex_lock(&event_lock);
  pthread_mutex_lock(&log_lock);
}

static void after_fork_in_parent(void) {
  pthread_mutex_unlock(&log_lock);
  pthread_mutex_unlock(&event_lock);
  pthread_mutex_unlock(&registry_lock);
}

static void after_fork_in_child(void) {
  registry = NULL;
  if (per_thread_stream != NULL) pthread_setspecific(per_thread_key, NULL);
  per_thread_stream = NULL;
  after_fork_in_parent();
}

__attribute__((constructor)) static void forget_streams_in_forked_children(void) {
  pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);
}

int fake_stream_enqueue(void* handle, fake_op* op) {
  fake_stream* stream = stream_acquire(handle);
  if (stream == NULL) {
    free(op);
    return kCudaErrorMemoryAllocation;
  }
  op->next = NULL;
  pthread_mutex_lock(&stream->lock);
  if (stream->tail != NULL)
    stream->tail->next = op;
  else
    stream->head = op;
  stream->tail = op;
  ++stream->enqueued;
  pthread_cond_broadcast(&stream->changed);
  pthread_mutex_unlock(&stream->lock);
  stream_release(stream);
  return kCudaSuccess;
}

void fake_stream_name(void* handle, char out[32]) {
  int own_index = 0;
  if ((uintptr_t)handle != 2) {
    pthread_mutex_lock(&registry_lock);
    fake_stream* stream = stream_find(stream_key(handle));
    if (stream != NULL) own_index = stream->own_index;
    pthread_mutex_unlock(&registry_lock);
  }
  if (own_index == 1)
    strcpy(out, "own");
  else if (own_index > 1)
    snprintf(out, 32, "own%d", own_index);
  else
    snprintf(out, 32, "0x%lx", (unsigned long)(uintptr_t)handle);
}

static void stream_drain(fake_stream* stream, uint64_t target) {
  pthread_mutex_lock(&stream->lock);
  while (stream->completed < target) pthread_cond_wait(&stream->changed, &stream->lock);
  pthread_mutex_unlock(&stream->lock);
}

void fake_drain_all_streams(void) {
  pthread_mutex_lock(&registry_lock);
  size_t count = 0;
  for (fake_stream* stream = registry; stream != NULL; stream = stream->next) ++count;
  fake_stream** streams = calloc(count + 1, sizeof *streams);
  uint64_t* targets = calloc(count + 1, sizeof *targets);
  size_t taken = 0;
  for (fake_stream* stream = registry; stream != NULL && streams != NULL && targets != NULL; stream = stream->next) {
    __atomic_add_fetch(&stream->refs, 1, __ATOMIC_ACQ_REL);
    pthread_mutex_lock(&stream->lock);
    targets[taken] = stream->enqueued;
    pthread_mutex_unlock(&stream->lock);
    streams[taken++] = stream;
  }
  pthread_mutex_unlock(&registry_lock);
  for (size_t i = 0; i < taken; ++i) {
    stream_drain(streams[i], targets[i]);
    stream_release(streams[i]);
  }
  free(streams);
  free(targets);
}

int cudaStreamCreateWithFlags(void** out, unsigned flags) {
  (void)flags;
  if (out == NULL) return kCudaErrorInvalidValue;
  pthread_mutex_lock(&registry_lock);
  int index = 1; /* the lowest free, so a test's stream is "own" again once earlier ones are destroyed */
  for (int taken = 1; taken;) {
    taken = 0;
    for (fake_stream* stream = registry; stream != NULL; stream = stream->next)
      if (stream->own_index == index) taken = 1;
    if (taken) ++index;
  }
  fake_stream* stream = stream_start(0, index, 0);
  pthread_mutex_unlock(&registry_lock);
  if (stream == NULL) return kCudaErrorMemoryAllocation;
  stream_release(stream);
  *out = stream;
  return kCudaSuccess;
}

int cudaStreamCreate(void** out) { return cudaStreamCreateWithFlags(out, 0); }

int cudaStreamDestroy(void* handle) {
  pthread_mutex_lock(&registry_lock);
  fake_stream* stream = stream_find((uintptr_t)handle);
  if (stream != NULL && stream->own_index == 0) stream = NULL;
  if (stream != NULL) __atomic_add_fetch(&stream->refs, 1, __ATOMIC_ACQ_REL);
  pthread_mutex_unlock(&registry_lock);
  if (stream == NULL) return kCudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&stream->lock);
  uint64_t target = stream->enqueued;
  pthread_mutex_unlock(&stream->lock);
  stream_drain(stream, target);
  stream_retire(stream);
  stream_release(stream);
  return kCudaSuccess;
}

int cudaStreamSynchronize(void* handle) {
  char name[32];
  fake_stream_name(handle, name);
  fake_note("sync %s", name);
  fake_stream* stream = stream_acquire(handle);
  if (stream == NULL) return kCudaErrorMemoryAllocation;
  pthread_mutex_lock(&stream->lock);
  uint64_t target = stream->enqueued;
  pthread_mutex_unlock(&stream->lock);
  stream_drain(stream, target);
  stream_release(stream);
  return kCudaSuccess;
}

int cudaStreamQuery(void* handle) {
  fake_stream* stream = stream_acquire(handle);
  if (stream == NULL) return kCudaErrorMemoryAllocation;
  pthread_mutex_lock(&stream->lock);
  int idle = stream->completed >= stream->enqueued;
  pthread_mutex_unlock(&stream->lock);
  stream_release(stream);
  return idle ? kCudaSuccess : kCudaErrorNotReady;
}

int cudaDeviceSynchronize(void) {
  fake_drain_all_streams();
  return kCudaSuccess;
}

/* ---- events: a record is a stream operation; waits and queries look at the latest record ---- */

typedef struct fake_event {
  uint64_t number;    /* evN in the log, counted from the last fake_reset() */
  uint64_t recorded;  /* records enqueued so far */
  uint64_t completed; /* highest record a worker has reached */
  int refs;
} fake_event;

typedef struct {
  fake_op base;
  fake_event* event;
  uint64_t target;
} event_op;

static void event_release_locked(fake_event* event) {
  if (--event->refs == 0) free(event);
}

int cudaEventCreateWithFlags(void** out, unsigned flags) {
  (void)flags;
  if (out == NULL) return kCudaErrorInvalidValue;
  fake_event* event = calloc(1, sizeof *event);
  if (event == NULL) return kCudaErrorMemoryAllocation;
  event->refs = 1;
  pthread_mutex_lock(&event_lock);
  event->number = ++next_event_number;
  pthread_mutex_unlock(&event_lock);
  *out = event;
  return kCudaSuccess;
}

int cudaEventCreate(void** out) { return cudaEventCreateWithFlags(out, 0); }

int cudaEventDestroy(void* handle) {
  if (handle == NULL) return kCudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&event_lock);
  event_release_locked(handle);
  pthread_mutex_unlock(&event_lock);
  return kCudaSuccess;
}

static void run_record(fake_op* base) {
  event_op* op = (event_op*)base;
  pthread_mutex_lock(&event_lock);
  if (op->event->completed < op->target) op->event->completed = op->target;
  pthread_cond_broadcast(&event_changed);
  event_release_locked(op->event);
  pthread_mutex_unlock(&event_lock);
  free(op);
}

static void run_wait(fake_op* base) {
  event_op* op = (event_op*)base;
  pthread_mutex_lock(&event_lock);
  while (op->event->completed < op->target) pthread_cond_wait(&event_changed, &event_lock);
  event_release_locked(op->event);
  pthread_mutex_unlock(&event_lock);
  free(op);
}

/* An event operation holding a reference; bump_record: this is a new record, else wait for the latest. */
static event_op* event_op_new(fake_event* event, int bump_record) {
  event_op* op = calloc(1, sizeof *op);
  if (op == NULL) return NULL;
  op->base.run = bump_record ? run_record : run_wait;
  op->event = event;
  pthread_mutex_lock(&event_lock);
  op->target = bump_record ? ++event->recorded : event->recorded;
  ++event->refs;
  pthread_mutex_unlock(&event_lock);
  return op;
}

int cudaEventRecord(void* handle, void* stream) {
  fake_event* event = handle;
  if (event == NULL) return kCudaErrorInvalidResourceHandle;
  char name[32];
  fake_stream_name(stream, name);
  fake_note("record ev%llu on %s %s device %d", (unsigned long long)event->number, name, fake_who(),
            current_device);
  event_op* op = event_op_new(event, 1);
  return op != NULL ? fake_stream_enqueue(stream, &op->base) : kCudaErrorMemoryAllocation;
}

int cudaStreamWaitEvent(void* stream, void* handle, unsigned flags) {
  (void)flags;
  fake_event* event = handle;
  if (event == NULL) return kCudaErrorInvalidResourceHandle;
  char name[32];
  fake_stream_name(stream, name);
  fake_note("wait %s ev%llu", name, (unsigned long long)event->number);
  event_op* op = event_op_new(event, 0);
  return op != NULL ? fake_stream_enqueue(stream, &op->base) : kCudaErrorMemoryAllocation;
}

int cudaEventQuery(void* handle) {
  fake_event* event = handle;
  if (event == NULL) return kCudaErrorInvalidResourceHandle;
  pthread_mutex_lock(&event_lock);
  int done = event->completed >= event->recorded;
  pthread_mutex_unlock(&event_lock);
  return done ? kCudaSuccess : kCudaErrorNotReady;
}

int cudaEventSynchronize(void* handle) {
  fake_event* event = handle;
  if (event == NULL) return kCudaErrorInvalidResourceHandle;
  fake_note("eventsync ev%llu", (unsigned long long)event->number);
  pthread_mutex_lock(&event_lock);
  uint64_t target = event->recorded;
  while (event->completed < target) pthread_cond_wait(&event_changed, &event_lock);
  pthread_mutex_unlock(&event_lock);
  return kCudaSuccess;
}
