/* The fake NCCL's API: communicators across real processes, collectives and send/recv as operations on
 * the caller's stream (run by that stream's worker, in launch order), groups, and NCCL's failure modes:
 * a peer that never arrives sets ncclRemoteError and the operation hangs until ncclCommAbort. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "fake_nccl.h"

typedef struct {
  char internal[128];
} ncclUniqueId;

_Static_assert(sizeof(fake_unique_id) == sizeof(ncclUniqueId), "the id layout fills ncclUniqueId exactly");

#define DEFAULT_SLOT_BYTES (4u << 20)
#define DEFAULT_CHANNEL_BYTES (1u << 20)
#define MIN_SLOT_BYTES 64u

int ncclGetVersion(int* version) {
  if (version == NULL) return kNcclInvalidArgument;
  *version = (int)fake_env_number("FAKE_NCCL_VERSION", 22105);
  return kNcclSuccess;
}

const char* ncclGetErrorString(int result) {
  switch (result) {
    case kNcclSuccess: return "no error";
    case kNcclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case kNcclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case kNcclInternalError: return "internal error - please report this issue to the NCCL developers";
    case kNcclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case kNcclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case kNcclRemoteError: return "remote process exited or there was a network error";
    case kNcclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

/* A fresh segment name, and the slot sizes every rank will use (FAKE_NCCL_SLOT_BYTES and
 * FAKE_NCCL_CHANNEL_BYTES of the process that asks, so small values can force chunking in tests). */
int ncclGetUniqueId(ncclUniqueId* out) {
  fake_note("uniqueid");
  if (out == NULL) return kNcclInvalidArgument;
  static uint32_t made;
  uint32_t serial = __atomic_add_fetch(&made, 1, __ATOMIC_RELAXED);
  uint64_t noise = 0;
  if (getrandom(&noise, sizeof noise, 0) != sizeof noise) noise = (uint64_t)(fake_now() * 1e9);
  fake_unique_id id;
  memset(&id, 0, sizeof id);
  memcpy(id.magic, "FAKENCCL", 8);
  double slot = fake_env_number("FAKE_NCCL_SLOT_BYTES", DEFAULT_SLOT_BYTES);
  double channel = fake_env_number("FAKE_NCCL_CHANNEL_BYTES", DEFAULT_CHANNEL_BYTES);
  id.slot_bytes = slot < MIN_SLOT_BYTES ? MIN_SLOT_BYTES : slot > (1u << 30) ? 1u << 30 : (uint32_t)slot / 8 * 8;
  id.channel_bytes = channel < 1 ? 1 : channel > (1u << 30) ? 1u << 30 : (uint32_t)channel;
  snprintf(id.name, sizeof id.name, "/fakenccl-%d-%u-%016llx", (int)getpid(), serial, (unsigned long long)noise);
  memcpy(out, &id, sizeof id);
  return kNcclSuccess;
}

static void comm_retain(fake_comm* comm) { __atomic_add_fetch(&comm->refs, 1, __ATOMIC_ACQ_REL); }

static void comm_release(fake_comm* comm) {
  if (__atomic_sub_fetch(&comm->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
  fake_region_close(comm);
  pthread_mutex_destroy(&comm->lock);
  pthread_cond_destroy(&comm->turn_changed);
  free(comm);
}

int ncclCommInitRank(fake_comm** out, int nranks, ncclUniqueId unique_id, int rank) {
  fake_unique_id id;
  memcpy(&id, &unique_id, sizeof id);
  if (out == NULL || nranks < 1 || rank < 0 || rank >= nranks || memcmp(id.magic, "FAKENCCL", 8) != 0 ||
      id.slot_bytes < MIN_SLOT_BYTES || id.channel_bytes < 1) {
    fake_note("init-bad-args");
    return kNcclInvalidArgument;
  }
  fake_note("init on device %d", fake_device());
  fake_comm* comm = calloc(1, sizeof *comm);
  if (comm == NULL) return kNcclSystemError;
  comm->nranks = nranks;
  comm->rank = rank;
  comm->device = fake_device();
  comm->timeout_s = fake_env_number("FAKE_NCCL_TIMEOUT_S", 60);
  comm->refs = 1;
  pthread_mutex_init(&comm->lock, NULL);
  pthread_cond_init(&comm->turn_changed, NULL);
  int result = fake_region_open(comm, &id);
  if (result != kNcclSuccess) {
    comm_release(comm);
    return result;
  }
  *out = comm;
  return kNcclSuccess;
}

int ncclCommDestroy(fake_comm* comm) {
  fake_note("destroy");
  if (comm == NULL) return kNcclInvalidArgument;
  comm->destroyed = 1;
  comm_release(comm); /* queued operations hold the region until they ran */
  return kNcclSuccess;
}

int ncclCommAbort(fake_comm* comm) {
  fake_note("abort");
  if (comm == NULL) return kNcclInvalidArgument;
  comm->destroyed = 1;
  __atomic_store_n(&comm->aborted, 1, __ATOMIC_RELEASE);
  fake_region_leave(comm);
  pthread_mutex_lock(&comm->lock);
  pthread_cond_broadcast(&comm->turn_changed);
  pthread_mutex_unlock(&comm->lock);
  comm_release(comm);
  return kNcclSuccess;
}

int ncclCommGetAsyncError(fake_comm* comm, int* error) {
  if (comm == NULL || error == NULL) return kNcclInvalidArgument;
  *error = __atomic_load_n(&comm->async_error, __ATOMIC_ACQUIRE);
  return kNcclSuccess;
}

int ncclCommCount(const fake_comm* comm, int* count) {
  if (comm == NULL || count == NULL) return kNcclInvalidArgument;
  *count = comm->nranks;
  return kNcclSuccess;
}

int ncclCommUserRank(const fake_comm* comm, int* rank) {
  if (comm == NULL || rank == NULL) return kNcclInvalidArgument;
  *rank = comm->rank;
  return kNcclSuccess;
}

/* A test's way to make a communicator report an asynchronous error. */
void fake_fail_comm(fake_comm* comm, int error) {
  fake_note("fail %d", error);
  if (comm != NULL) __atomic_store_n(&comm->async_error, error, __ATOMIC_RELEASE);
}

/* ---- collectives ---- */

typedef enum { kAllReduce, kBroadcast, kAllGather, kReduceScatter, kReduce } collective_kind;

typedef struct {
  fake_op base;
  fake_comm* comm;
  uint64_t seq;
  collective_kind kind;
  const char* send;
  char* recv;
  size_t count; /* per rank for allgather and reducescatter */
  int dtype, op, root;
  int premul;               /* a PreMulSum op: every rank's input is multiplied by scalar, then summed */
  unsigned char scalar[8];  /* copied at launch, so the op may be destroyed right after */
} collective_op;

/* Each phase: every rank fills its slot, barrier, every rank reads what it needs, barrier (so no slot is
 * overwritten while a peer still reads it). Returns -1 once aborted. */
static int run_chunks(collective_op* op) {
  fake_comm* comm = op->comm;
  size_t element = fake_dtype_bytes(op->dtype), ranks = (size_t)comm->nranks;
  size_t chunk = comm->slot_bytes / element / (op->kind == kReduceScatter ? ranks : 1);
  for (size_t offset = 0; offset < op->count; offset += chunk) {
    size_t n = op->count - offset < chunk ? op->count - offset : chunk, bytes = n * element;
    char* mine = fake_slot(comm, comm->rank);
    if (op->kind == kReduceScatter) {
      for (size_t target = 0; target < ranks; ++target)
        memcpy(mine + target * bytes, op->send + (target * op->count + offset) * element, bytes);
    } else if (op->kind != kBroadcast || comm->rank == op->root) {
      memcpy(mine, op->send + offset * element, bytes);
    }
    if (op->premul) fake_multiply(mine, op->kind == kReduceScatter ? n * ranks : n, op->dtype, op->scalar);
    if (fake_barrier(comm) != 0) return -1;
    if (op->kind == kAllGather) {
      for (size_t source = 0; source < ranks; ++source)
        memcpy(op->recv + (source * op->count + offset) * element, fake_slot(comm, (int)source), bytes);
    } else if (op->kind == kBroadcast) {
      memcpy(op->recv + offset * element, fake_slot(comm, op->root), bytes);
    } else if (op->kind == kReduce && comm->rank != op->root) {
      /* only the root receives: the other ranks' recv buffers stay untouched */
    } else { /* reduce in rank order, so every rank computes bit-identical results */
      size_t part = op->kind == kReduceScatter ? (size_t)comm->rank * bytes : 0;
      char* out = op->recv + offset * element;
      int reduce = op->op == kAvg ? kSum : op->op;
      memcpy(out, fake_slot(comm, 0) + part, bytes);
      for (int source = 1; source < comm->nranks; ++source)
        fake_reduce(out, fake_slot(comm, source) + part, n, op->dtype, reduce);
      if (op->op == kAvg) fake_average(out, n, op->dtype, comm->nranks);
    }
    if (fake_barrier(comm) != 0) return -1;
  }
  return 0;
}

/* Runs on the stream's worker: waits for the previous collective on the communicator, then moves data. */
static void run_collective(fake_op* base) {
  collective_op* op = (collective_op*)base;
  fake_comm* comm = op->comm;
  pthread_mutex_lock(&comm->lock);
  while (comm->done_seq + 1 < op->seq && !__atomic_load_n(&comm->aborted, __ATOMIC_ACQUIRE))
    pthread_cond_wait(&comm->turn_changed, &comm->lock);
  pthread_mutex_unlock(&comm->lock);
  if (!__atomic_load_n(&comm->aborted, __ATOMIC_ACQUIRE)) run_chunks(op); /* aborted: no result */
  pthread_mutex_lock(&comm->lock);
  if (comm->done_seq < op->seq) comm->done_seq = op->seq;
  pthread_cond_broadcast(&comm->turn_changed);
  pthread_mutex_unlock(&comm->lock);
  comm_release(comm);
  free(op);
}

typedef struct {
  fake_op base;
  fake_comm* comm;
  int count;
  fake_transfer transfers[];
} exchange_op;

static void run_exchange(fake_op* base) {
  exchange_op* op = (exchange_op*)base;
  if (!__atomic_load_n(&op->comm->aborted, __ATOMIC_ACQUIRE)) fake_exchange(op->comm, op->transfers, op->count);
  comm_release(op->comm);
  free(op);
}

/* ---- groups: operations launched between ncclGroupStart and ncclGroupEnd go to their streams at the
 * end; the sends and receives of one communicator and stream run together, so their order cannot
 * deadlock ---- */

typedef struct pending {
  fake_op* op;          /* a collective, or NULL for a transfer */
  fake_comm* comm;      /* transfers only: holds a reference */
  void* stream;
  fake_transfer transfer;
  struct pending* next;
} pending;

static __thread int group_depth;
static __thread pending *group_head, *group_tail;

static int remember(pending entry) {
  pending* copy = malloc(sizeof *copy);
  if (copy == NULL) return kNcclSystemError;
  *copy = entry;
  copy->next = NULL;
  if (group_tail != NULL)
    group_tail->next = copy;
  else
    group_head = copy;
  group_tail = copy;
  return kNcclSuccess;
}

static int enqueue(void* stream, fake_op* op) {
  return fake_stream_enqueue(stream, op) == kCudaSuccess ? kNcclSuccess : kNcclUnhandledCudaError;
}

/* One exchange operation with the transfers in list that share first's communicator and stream, which
 * leave list; the transfers' references move to the operation. */
static int enqueue_exchange(pending* first) {
  int count = 0;
  for (pending* entry = first; entry != NULL; entry = entry->next)
    if (entry->op == NULL && entry->comm == first->comm && entry->stream == first->stream) ++count;
  exchange_op* op = calloc(1, sizeof *op + (size_t)count * sizeof(fake_transfer));
  if (op == NULL) return kNcclSystemError;
  op->base.run = run_exchange;
  op->comm = first->comm;
  comm_retain(op->comm);
  void* stream = first->stream;
  fake_comm* comm = first->comm;
  for (pending* entry = first; entry != NULL; entry = entry->next) {
    if (entry->op == NULL && entry->comm == comm && entry->stream == stream) {
      op->transfers[op->count++] = entry->transfer;
      comm_release(entry->comm);
      entry->comm = NULL; /* taken */
    }
  }
  return enqueue(stream, &op->base);
}

int ncclGroupStart(void) {
  fake_note("groupstart");
  ++group_depth;
  return kNcclSuccess;
}

int ncclGroupEnd(void) {
  fake_note("groupend");
  if (group_depth == 0) return kNcclInvalidUsage;
  if (--group_depth > 0) return kNcclSuccess;
  int result = kNcclSuccess;
  for (pending* entry = group_head; entry != NULL; entry = entry->next) {
    int launched = kNcclSuccess;
    if (entry->op != NULL)
      launched = enqueue(entry->stream, entry->op);
    else if (entry->comm != NULL)
      launched = enqueue_exchange(entry);
    if (result == kNcclSuccess) result = launched;
  }
  while (group_head != NULL) {
    pending* next = group_head->next;
    free(group_head);
    group_head = next;
  }
  group_tail = NULL;
  return result;
}

static int launch(fake_op* op, void* stream) {
  if (group_depth > 0) return remember((pending){.op = op, .stream = stream});
  return enqueue(stream, op);
}

static int usable(const fake_comm* comm) { return comm != NULL && !comm->destroyed; }

static int is_reduction(collective_kind kind) {
  return kind == kAllReduce || kind == kReduceScatter || kind == kReduce;
}

static int collective(collective_kind kind, const void* send, void* recv, size_t count, int dtype, int op,
                      int root, fake_comm* comm, void* stream) {
  if (!usable(comm) || fake_dtype_bytes(dtype) == 0 || op < 0 || root < 0 || root >= comm->nranks ||
      (count > 0 && recv == NULL && (kind != kReduce || comm->rank == root)) || /* only the root receives */
      (count > 0 && send == NULL && (kind != kBroadcast || comm->rank == root))) /* only the root sends */
    return kNcclInvalidArgument;
  int premul = 0;
  unsigned char scalar[8] = {0};
  if (op >= kOpCount) { /* a PreMulSum of this communicator, of this type, for a reduction */
    pthread_mutex_lock(&comm->lock);
    const fake_user_op* user = op - kOpCount < FAKE_MAX_USER_OPS ? &comm->user_ops[op - kOpCount] : NULL;
    int valid = user != NULL && user->in_use && user->dtype == dtype && is_reduction(kind);
    if (valid) memcpy(scalar, user->scalar, sizeof scalar);
    pthread_mutex_unlock(&comm->lock);
    if (!valid) {
      fake_note("bad-op %d", op);
      return kNcclInvalidArgument;
    }
    premul = 1;
    op = kSum;
  }
  collective_op* queued = calloc(1, sizeof *queued);
  if (queued == NULL) return kNcclSystemError;
  *queued = (collective_op){.base.run = run_collective, .comm = comm, .kind = kind, .send = send,
                            .recv = recv, .count = count, .dtype = dtype, .op = op, .root = root,
                            .premul = premul};
  memcpy(queued->scalar, scalar, sizeof scalar);
  comm_retain(comm);
  pthread_mutex_lock(&comm->lock);
  queued->seq = ++comm->next_seq;
  pthread_mutex_unlock(&comm->lock);
  return launch(&queued->base, stream);
}

/* Only a host-immediate factor (ncclScalarHostImmediate): the fake does not model a factor read from
 * device memory at run time. */
int ncclRedOpCreatePreMulSum(int* op, void* scalar, int dtype, int residence, fake_comm* comm) {
  fake_note("premulsum type %d", dtype);
  if (op == NULL || scalar == NULL || !usable(comm) || fake_dtype_bytes(dtype) == 0 || residence != 1)
    return kNcclInvalidArgument;
  int result = kNcclInternalError; /* every slot taken: ops are leaking */
  pthread_mutex_lock(&comm->lock);
  for (int index = 0; index < FAKE_MAX_USER_OPS; ++index) {
    fake_user_op* user = &comm->user_ops[index];
    if (user->in_use) continue;
    user->in_use = 1;
    user->dtype = dtype;
    memset(user->scalar, 0, sizeof user->scalar);
    memcpy(user->scalar, scalar, fake_dtype_bytes(dtype));
    *op = kOpCount + index;
    result = kNcclSuccess;
    break;
  }
  pthread_mutex_unlock(&comm->lock);
  return result;
}

int ncclRedOpDestroy(int op, fake_comm* comm) {
  fake_note("opdestroy %d", op);
  if (!usable(comm) || op < kOpCount || op - kOpCount >= FAKE_MAX_USER_OPS) return kNcclInvalidArgument;
  pthread_mutex_lock(&comm->lock);
  fake_user_op* user = &comm->user_ops[op - kOpCount];
  int result = user->in_use ? kNcclSuccess : kNcclInvalidArgument;
  user->in_use = 0;
  pthread_mutex_unlock(&comm->lock);
  return result;
}

int ncclAllReduce(const void* send, void* recv, size_t count, int dtype, int op, fake_comm* comm, void* stream) {
  fake_note("allreduce %zu type %d op %d %s", count, dtype, op, fake_who());
  return collective(kAllReduce, send, recv, count, dtype, op, 0, comm, stream);
}

int ncclBroadcast(const void* send, void* recv, size_t count, int dtype, int root, fake_comm* comm, void* stream) {
  fake_note("broadcast %zu root %d", count, root);
  return collective(kBroadcast, send, recv, count, dtype, kSum, root, comm, stream);
}

int ncclReduce(const void* send, void* recv, size_t count, int dtype, int op, int root, fake_comm* comm,
               void* stream) {
  fake_note("reduce %zu type %d op %d root %d %s", count, dtype, op, root, fake_who());
  return collective(kReduce, send, recv, count, dtype, op, root, comm, stream);
}

int ncclAllGather(const void* send, void* recv, size_t count, int dtype, fake_comm* comm, void* stream) {
  fake_note("allgather %zu type %d %s", count, dtype, fake_who());
  return collective(kAllGather, send, recv, count, dtype, kSum, 0, comm, stream);
}

int ncclReduceScatter(const void* send, void* recv, size_t count, int dtype, int op, fake_comm* comm,
                      void* stream) {
  fake_note("reducescatter %zu type %d op %d %s", count, dtype, op, fake_who());
  return collective(kReduceScatter, send, recv, count, dtype, op, 0, comm, stream);
}

static int transfer(int is_send, void* buffer, size_t count, int dtype, int peer, fake_comm* comm, void* stream) {
  if (!usable(comm) || fake_dtype_bytes(dtype) == 0 || peer < 0 || peer >= comm->nranks ||
      (count > 0 && buffer == NULL))
    return kNcclInvalidArgument;
  fake_transfer item = {.is_send = is_send, .peer = peer, .buffer = buffer, .bytes = count * fake_dtype_bytes(dtype)};
  comm_retain(comm);
  if (group_depth > 0) {
    int result = remember((pending){.comm = comm, .stream = stream, .transfer = item});
    if (result != kNcclSuccess) comm_release(comm);
    return result;
  }
  exchange_op* op = calloc(1, sizeof *op + sizeof(fake_transfer));
  if (op == NULL) {
    comm_release(comm);
    return kNcclSystemError;
  }
  op->base.run = run_exchange;
  op->comm = comm;
  op->count = 1;
  op->transfers[0] = item;
  return enqueue(stream, &op->base);
}

int ncclSend(const void* send, size_t count, int dtype, int peer, fake_comm* comm, void* stream) {
  fake_note("send %zu type %d peer %d", count, dtype, peer);
  return transfer(1, (void*)send, count, dtype, peer, comm, stream);
}

int ncclRecv(void* recv, size_t count, int dtype, int peer, fake_comm* comm, void* stream) {
  fake_note("recv %zu type %d peer %d", count, dtype, peer);
  return transfer(0, recv, count, dtype, peer, comm, stream);
}
