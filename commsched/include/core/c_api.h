/* commsched's C ABI (shipped with the package, so separately built code can include it): lets code compiled apart from the Python module (the TensorFlow
 * custom ops) reach the process's one runtime. Look the table up with
 * dlopen(<path of commsched/_core*.so>, RTLD_NOW | RTLD_NOLOAD) and
 * dlsym(handle, "commsched_api_v1"). */
#ifndef COMMSCHED_C_API_H_
#define COMMSCHED_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dtype codes match commsched::DType; op codes commsched::ReduceOp. */
enum {
  COMMSCHED_FLOAT16 = 0,
  COMMSCHED_BFLOAT16 = 1,
  COMMSCHED_FLOAT32 = 2,
  COMMSCHED_FLOAT64 = 3,
  COMMSCHED_INT32 = 4,
  COMMSCHED_INT64 = 5,
  COMMSCHED_UINT8 = 6,
  COMMSCHED_INT8 = 7
};
enum { COMMSCHED_OP_SUM = 0, COMMSCHED_OP_AVERAGE = 1 };
enum { COMMSCHED_ALLREDUCE = 0, COMMSCHED_BROADCAST = 1 };

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

#ifdef __cplusplus
}
#endif

#endif /* COMMSCHED_C_API_H_ */
