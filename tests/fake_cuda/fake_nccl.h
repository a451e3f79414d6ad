/* The fake NCCL's internals: a communicator is a POSIX shared-memory region every rank maps; collectives
 * move data through one fixed-size slot per rank between barriers, send/recv through a ring per ordered
 * pair of ranks. Shared words are futexes, so waiting ranks sleep instead of spinning. */
#pragma once

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "fake_cuda.h"

#pragma GCC visibility push(hidden)

enum {
  kNcclSuccess = 0,
  kNcclUnhandledCudaError = 1,
  kNcclSystemError = 2,
  kNcclInternalError = 3,
  kNcclInvalidArgument = 4,
  kNcclInvalidUsage = 5,
  kNcclRemoteError = 6,
  kNcclInProgress = 7,
};
enum { kSum = 0, kProd = 1, kMax = 2, kMin = 3, kAvg = 4, kOpCount = 5 };
enum {
  kInt8, kUint8, kInt32, kUint32, kInt64, kUint64, kFloat16, kFloat32, kFloat64, kBfloat16, kDtypeCount
};

/* What ncclGetUniqueId puts in the 128 bytes of an ncclUniqueId. */
typedef struct {
  char magic[8];          /* "FAKENCCL" */
  uint32_t slot_bytes;    /* per rank, for collectives */
  uint32_t channel_bytes; /* per ordered pair of ranks, for send/recv */
  char name[112];         /* the shared-memory segment, "/fakenccl-..." */
} fake_unique_id;

typedef struct fake_region_header fake_region_header;
typedef struct fake_rank_words fake_rank_words;
typedef struct fake_channel_words fake_channel_words;

/* Reduction ops made with ncclRedOpCreatePreMulSum: NCCL numbers them from ncclNumOps (kOpCount). */
#define FAKE_MAX_USER_OPS 64
typedef struct {
  int in_use, dtype;
  unsigned char scalar[8]; /* the factor, in the op's dtype */
} fake_user_op;

typedef struct fake_comm {
  int nranks, rank, device;
  double timeout_s; /* FAKE_NCCL_TIMEOUT_S when the communicator was made */
  char* base;       /* the mapped region */
  size_t size;
  uint32_t slot_bytes, channel_bytes;
  fake_region_header* header;
  fake_rank_words* ranks;       /* [nranks] */
  fake_channel_words* channels; /* [nranks * nranks], sender-major */
  char* slots;                  /* [nranks][slot_bytes] */
  char* channel_data;           /* [nranks * nranks][channel_bytes] */
  uint32_t barriers;            /* passed so far; only the collective holding the turn touches it */
  pthread_mutex_t lock;
  pthread_cond_t turn_changed;
  uint64_t next_seq, done_seq; /* collectives run in launch order, one at a time */
  int refs;                    /* the user's, and one per queued operation */
  int aborted, destroyed, async_error;
  fake_user_op user_ops[FAKE_MAX_USER_OPS]; /* this communicator's, as in NCCL */
} fake_comm;

/* Maps (or creates) the region named in id and waits for all ranks; returns an ncclResult_t. */
int fake_region_open(fake_comm* comm, const fake_unique_id* id);
void fake_region_close(fake_comm* comm);
/* Tells peers this rank is gone (ncclCommAbort), so their waits fail at once instead of at the timeout. */
void fake_region_leave(fake_comm* comm);
/* Waits until every rank reached the same barrier: 0, or -1 once the communicator is aborted. A peer late
 * by more than the timeout sets ncclRemoteError and the wait goes on, as a hung kernel would. */
int fake_barrier(fake_comm* comm);
char* fake_slot(fake_comm* comm, int rank);

typedef struct {
  int is_send;
  int peer;
  char* buffer;
  size_t bytes, done;
} fake_transfer;
/* Runs the sends and receives together until all are done: 0, or -1 once aborted. */
int fake_exchange(fake_comm* comm, fake_transfer* transfers, int count);
/* Sets the communicator's async error unless one is already set. */
void fake_comm_failed(fake_comm* comm, int error);

size_t fake_dtype_bytes(int dtype); /* 0 for an unknown type */
/* out[i] = op(out[i], in[i]) in the type's arithmetic; sum for kAvg (finish with fake_average). */
void fake_reduce(void* out, const void* in, size_t count, int dtype, int op);
void fake_average(void* data, size_t count, int dtype, int nranks);
/* data[i] *= scalar in the type's arithmetic (scalar holds one element of dtype): PreMulSum's step. */
void fake_multiply(void* data, size_t count, int dtype, const unsigned char* scalar);

#pragma GCC visibility pop
