/* commsched's C ABI (shipped with the package, so separately built code can include it): lets code compiled apart from the Python module (the TensorFlow
 * custom ops) reach the process's one runtime. Look the table up with
 * dlopen(<path of commsched/_core*.so>, RTLD_NOW | RTLD_NOLOAD) and
 * dlsym(handle, "commsched_api_v2") (or "commsched_api_v1", allreduce and broadcast only). */
#ifndef COMMSCHED_C_API_H_
#define COMMSCHED_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dtype codes match commsched::DType; op codes commsched::ReduceOp; kind codes commsched::CollectiveKind. */
enum {
  COMMSCHED_FLOAT16 = 0,
  COMMSCHED_BFLOAT16 = 1,
  COMMSCHED_FLOAT32 = 2,
  COMMSCHED_FLOAT64 = 3,
  COMMSCHED_INT32 = 4,
  COMMSCHED_INT64 = 5,
  COMMSCHED_UINT8 = 6,
  COMMSCHED_INT8 = 7,
  COMMSCHED_INT16 = 8,
  COMMSCHED_BOOL = 9
};
enum {
  COMMSCHED_OP_SUM = 0,
  COMMSCHED_OP_AVERAGE = 1,
  COMMSCHED_OP_MIN = 2,
  COMMSCHED_OP_MAX = 3,
  COMMSCHED_OP_PRODUCT = 4
};
enum {
  COMMSCHED_ALLREDUCE = 0,
  COMMSCHED_BROADCAST = 1,
  COMMSCHED_ALLGATHER = 2,
  COMMSCHED_REDUCESCATTER = 3,
  COMMSCHED_ALLTOALL = 4,
  COMMSCHED_BARRIER = 5
};

/* Called once when the collective finished: error is NULL on success, else a message
 * valid only during the call. Runs on commsched's thread: must not block. */
typedef void (*commsched_done_fn)(void* context, const char* error);

typedef struct commsched_api_v1_t {
  uint32_t version; /* 1 */
  /* Submits an in-place collective on `data`, which must stay valid until `done` runs.
   * Returns 0, or -1 with a message in error[0..error_size). On -1, done is never called. */
  int (*submit)(const char* name, void* data, uint64_t count, int dtype, int op, int kind, int root, int priority,
                commsched_done_fn done, void* context, char* error, size_t error_size);
  int (*rank)(void); /* -1 when not initialised */
  int (*size)(void); /* -1 when not initialised */
  int (*running)(void);
} commsched_api_v1_t;

extern const commsched_api_v1_t commsched_api_v1;

/* Version 2: every collective, scale factors, shapes and splits, groups, and results the core
 * allocates (allgather, reducescatter, alltoall). */

/* The result of a collective with an output, valid only during the done call: `elements` of the
 * request's dtype at `data` (host memory), and the agreed layout in elements: allgather and
 * reducescatter, what each rank holds, by rank; alltoall, what rank s sends to rank d at
 * [s * size + d]. */
typedef struct commsched_result_t {
  const void* data;
  uint64_t elements;
  const uint64_t* layout;
  size_t layout_size;
} commsched_result_t;

/* Called once when the collective finished. On success error is NULL and result is the output
 * (NULL for allreduce, broadcast and barrier, whose result is in place); on failure error is a
 * message and result NULL. Both are valid only during the call, which runs on commsched's
 * thread and must not block. */
typedef void (*commsched_result_fn)(void* context, const commsched_result_t* result, const char* error);

typedef struct commsched_request_t {
  const char* name;
  void* data;     /* allreduce, broadcast: reduced in place; others: read until done runs */
  uint64_t count; /* elements at data */
  int32_t dtype;
  int32_t op; /* reductions (allreduce, reducescatter) */
  int32_t kind;
  int32_t root; /* broadcast */
  int32_t priority;
  int32_t process_set_id; /* 0: every rank; else a set from add_process_set(), which this rank is in */
  double prescale;        /* reductions: applied before; 1 leaves the data as it is */
  double postscale;       /* reductions: applied after */
  /* extents of one row (all dimensions but the first); every rank's must match, so equal-size
   * tensors of different shapes fail. allgather, reducescatter, alltoall: the rows' layout */
  const uint64_t* row_shape;
  size_t row_rank;
  /* alltoall: rows sent to each rank, one per rank */
  const uint64_t* splits;
  size_t num_splits;
  commsched_result_fn done;
  void* context;
} commsched_request_t;

typedef struct commsched_api_v2_t {
  uint32_t version; /* 2 */
  /* Submits `count` requests; more than one form a group that every rank agrees on at once
   * (allreduces only). Returns 0, or -1 with a message in error[0..error_size), in which case no
   * done is ever called and every rank's collective under those names fails with the message. */
  int (*submit)(const commsched_request_t* requests, size_t count, char* error, size_t error_size);
  int (*rank)(void); /* -1 when not initialised */
  int (*size)(void); /* -1 when not initialised */
  int (*running)(void);
  /* Tells every rank that this rank refuses the collective `name` for `reason` (a submission
   * this rank cannot make), so theirs fail with it instead of waiting. */
  void (*refuse)(const char* name, const char* reason);
  /* Appended later, so older callers that read only the fields above still work. */
  int (*process_set_rank)(int32_t process_set_id); /* position in the set; -1: not a member or unknown */
  int (*process_set_size)(int32_t process_set_id); /* -1 when unknown */
  /* refuse() for a collective on a process set; `name` as submitted (without the set's prefix). */
  void (*refuse_on_set)(const char* name, const char* reason, int32_t process_set_id);
} commsched_api_v2_t;

extern const commsched_api_v2_t commsched_api_v2;

#ifdef __cplusplus
}
#endif

#endif /* COMMSCHED_C_API_H_ */
