/* The fake NCCL's shared memory: the region every rank of a communicator maps, the barrier between the
 * phases of a collective, and the per-pair rings that carry send/recv. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fake_nccl.h"

#define REGION_READY 0x46414b45u /* set last by the creator: the header below is filled in */
#define WAIT_SLICE_US 20000u    /* waits wake this often to notice an abort or the timeout */

struct fake_region_header {
  uint32_t ready;
  uint32_t nranks, slot_bytes, channel_bytes;
  uint64_t size;
  char pad[40];
};

struct fake_rank_words {
  uint32_t progress; /* barriers this rank has reached */
  uint32_t bell;     /* bumped whenever a peer moves data to or from this rank's rings */
  uint32_t gone;     /* set by ncclCommAbort */
  uint32_t joined;
  char pad[48];
};

struct fake_channel_words {
  uint64_t written, read; /* bytes through the ring so far */
  char pad[48];
};

static size_t align_up(size_t value, size_t alignment) { return (value + alignment - 1) / alignment * alignment; }

/* Lays the region out in comm from its base; returns its size. */
static size_t lay_out(fake_comm* comm) {
  size_t n = (size_t)comm->nranks;
  size_t ranks_at = align_up(sizeof(fake_region_header), 64);
  size_t channels_at = ranks_at + n * sizeof(fake_rank_words);
  size_t slots_at = align_up(channels_at + n * n * sizeof(fake_channel_words), 4096);
  size_t channel_data_at = slots_at + n * comm->slot_bytes;
  size_t size = channel_data_at + n * n * comm->channel_bytes;
  if (comm->base != NULL) {
    comm->header = (fake_region_header*)comm->base;
    comm->ranks = (fake_rank_words*)(comm->base + ranks_at);
    comm->channels = (fake_channel_words*)(comm->base + channels_at);
    comm->slots = comm->base + slots_at;
    comm->channel_data = comm->base + channel_data_at;
  }
  return size;
}

char* fake_slot(fake_comm* comm, int rank) { return comm->slots + (size_t)rank * comm->slot_bytes; }

void fake_comm_failed(fake_comm* comm, int error) {
  int none = kNcclSuccess;
  __atomic_compare_exchange_n(&comm->async_error, &none, error, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

static int aborted(fake_comm* comm) { return __atomic_load_n(&comm->aborted, __ATOMIC_ACQUIRE); }

/* Opens the segment, creating it if this rank is first; the creator sizes it. -1 past the deadline. */
static int open_segment(const char* name, size_t size, double deadline, int* created) {
  for (;;) {
    int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
    if (fd >= 0) {
      *created = 1;
      if (ftruncate(fd, (off_t)size) == 0) return fd;
      close(fd);
      shm_unlink(name);
      return -1;
    }
    if (errno != EEXIST) return -1;
    fd = shm_open(name, O_RDWR, 0);
    if (fd >= 0) {
      *created = 0;
      return fd;
    }
    /* ENOENT: it was unlinked between the two calls (a failed init); try creating it again */
    if (errno != ENOENT || fake_now() > deadline) return -1;
  }
}

/* Waits until every rank's progress reached target. 0; -1 when aborted; -2 past the deadline when
 * give_up, else a late or departed peer sets ncclRemoteError and the wait goes on until an abort. */
static int await_ranks(fake_comm* comm, uint32_t target, double deadline, int give_up) {
  for (int peer = 0; peer < comm->nranks; ++peer) {
    fake_rank_words* words = &comm->ranks[peer];
    for (;;) {
      uint32_t seen = __atomic_load_n(&words->progress, __ATOMIC_ACQUIRE);
      if ((int32_t)(seen - target) >= 0) break;
      if (aborted(comm)) return -1;
      if (fake_now() > deadline || __atomic_load_n(&words->gone, __ATOMIC_ACQUIRE)) {
        if (give_up) return -2;
        fake_comm_failed(comm, kNcclRemoteError);
      }
      fake_wait_word(&words->progress, seen, WAIT_SLICE_US);
    }
  }
  return 0;
}

static void arrive(fake_comm* comm, uint32_t barrier) {
  uint32_t* progress = &comm->ranks[comm->rank].progress;
  __atomic_store_n(progress, barrier, __ATOMIC_RELEASE);
  fake_wake_word(progress);
}

int fake_barrier(fake_comm* comm) {
  uint32_t barrier = ++comm->barriers;
  arrive(comm, barrier);
  return await_ranks(comm, barrier, fake_now() + comm->timeout_s, 0) == 0 ? 0 : -1;
}

/* A one-rank communicator needs no name: private shared memory, same layout. */
static int open_alone(fake_comm* comm, size_t size) {
  void* base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (base == MAP_FAILED) return kNcclSystemError;
  comm->base = base;
  comm->size = size;
  lay_out(comm);
  comm->header->nranks = 1;
  comm->barriers = 1;
  arrive(comm, 1);
  return kNcclSuccess;
}

int fake_region_open(fake_comm* comm, const fake_unique_id* id) {
  /* a reducescatter phase needs room for at least one 8-byte element per rank */
  uint32_t least = 8u * (uint32_t)comm->nranks;
  comm->slot_bytes = id->slot_bytes < least ? least : id->slot_bytes;
  comm->channel_bytes = id->channel_bytes;
  size_t size = lay_out(comm);
  if (comm->nranks == 1) return open_alone(comm, size);
  double deadline = fake_now() + comm->timeout_s;
  int created = 0;
  int fd = open_segment(id->name, size, deadline, &created);
  if (fd < 0) return kNcclSystemError;
  struct stat status;
  while (fstat(fd, &status) == 0 && status.st_size == 0 && fake_now() < deadline) fake_sleep_us(200);
  if (status.st_size != (off_t)size) { /* another rank sized it for a different nranks */
    close(fd);
    return status.st_size == 0 ? kNcclSystemError : kNcclInvalidArgument;
  }
  void* base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return kNcclSystemError;
  comm->base = base;
  comm->size = size;
  lay_out(comm);
  fake_region_header* header = comm->header;
  if (created) {
    header->nranks = (uint32_t)comm->nranks;
    header->slot_bytes = comm->slot_bytes;
    header->channel_bytes = comm->channel_bytes;
    header->size = size;
    __atomic_store_n(&header->ready, REGION_READY, __ATOMIC_RELEASE);
    fake_wake_word(&header->ready);
  }
  uint32_t ready;
  while ((ready = __atomic_load_n(&header->ready, __ATOMIC_ACQUIRE)) != REGION_READY && fake_now() < deadline)
    fake_wait_word(&header->ready, ready, 1000);
  int result = kNcclSuccess;
  uint32_t unjoined = 0;
  if (ready != REGION_READY)
    result = kNcclSystemError;
  else if (header->nranks != (uint32_t)comm->nranks)
    result = kNcclInvalidArgument;
  else if (!__atomic_compare_exchange_n(&comm->ranks[comm->rank].joined, &unjoined, 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
    result = kNcclInvalidUsage; /* two processes claimed the same rank */
  if (result == kNcclSuccess) {
    comm->barriers = 1;
    arrive(comm, 1);
    if (await_ranks(comm, 1, deadline, 1) != 0) {
      __atomic_store_n(&comm->ranks[comm->rank].gone, 1, __ATOMIC_RELEASE);
      result = kNcclSystemError;
    }
  }
  /* Every rank mapped the segment once all arrived: the name is no longer needed. A failed init
   * removes it too, so no segment outlives its communicator. */
  if (result != kNcclSuccess || comm->rank == 0) shm_unlink(id->name);
  if (result != kNcclSuccess) {
    munmap(comm->base, comm->size);
    comm->base = NULL;
  }
  return result;
}

void fake_region_leave(fake_comm* comm) {
  __atomic_store_n(&comm->ranks[comm->rank].gone, 1, __ATOMIC_RELEASE);
  for (int peer = 0; peer < comm->nranks; ++peer) {
    fake_wake_word(&comm->ranks[peer].progress);
    fake_wake_word(&comm->ranks[peer].bell);
  }
}

void fake_region_close(fake_comm* comm) {
  if (comm->base != NULL) munmap(comm->base, comm->size);
  comm->base = NULL;
}

/* ---- send/recv: a byte ring per ordered pair (sender, receiver), matched in the order posted ---- */

static void ring_bell(fake_comm* comm, int peer) {
  __atomic_add_fetch(&comm->ranks[peer].bell, 1, __ATOMIC_ACQ_REL);
  fake_wake_word(&comm->ranks[peer].bell);
}

/* Moves what the ring allows for one transfer; returns the bytes moved. */
static size_t step(fake_comm* comm, fake_transfer* transfer) {
  int sender = transfer->is_send ? comm->rank : transfer->peer;
  int receiver = transfer->is_send ? transfer->peer : comm->rank;
  size_t index = (size_t)sender * (size_t)comm->nranks + (size_t)receiver;
  fake_channel_words* words = &comm->channels[index];
  char* ring = comm->channel_data + index * comm->channel_bytes;
  uint64_t written = __atomic_load_n(&words->written, __ATOMIC_ACQUIRE);
  uint64_t read = __atomic_load_n(&words->read, __ATOMIC_ACQUIRE);
  size_t available = transfer->is_send ? comm->channel_bytes - (size_t)(written - read) : (size_t)(written - read);
  size_t bytes = transfer->bytes - transfer->done;
  if (bytes > available) bytes = available;
  uint64_t position = transfer->is_send ? written : read;
  for (size_t moved = 0; moved < bytes;) {
    size_t at = (size_t)((position + moved) % comm->channel_bytes);
    size_t piece = bytes - moved < comm->channel_bytes - at ? bytes - moved : comm->channel_bytes - at;
    if (transfer->is_send)
      memcpy(ring + at, transfer->buffer + transfer->done + moved, piece);
    else
      memcpy(transfer->buffer + transfer->done + moved, ring + at, piece);
    moved += piece;
  }
  if (bytes == 0) return 0;
  transfer->done += bytes;
  __atomic_store_n(transfer->is_send ? &words->written : &words->read, position + bytes, __ATOMIC_RELEASE);
  ring_bell(comm, transfer->peer);
  return bytes;
}

int fake_exchange(fake_comm* comm, fake_transfer* transfers, int count) {
  uint32_t* bell = &comm->ranks[comm->rank].bell;
  double deadline = fake_now() + comm->timeout_s;
  for (;;) {
    uint32_t rung = __atomic_load_n(bell, __ATOMIC_ACQUIRE);
    int pending = 0, moved = 0, peer_gone = 0;
    for (int i = 0; i < count; ++i) {
      if (transfers[i].done == transfers[i].bytes) continue;
      moved |= step(comm, &transfers[i]) > 0;
      pending |= transfers[i].done < transfers[i].bytes;
      peer_gone |= __atomic_load_n(&comm->ranks[transfers[i].peer].gone, __ATOMIC_ACQUIRE) != 0;
    }
    if (!pending) return 0;
    if (aborted(comm)) return -1;
    if (moved) {
      deadline = fake_now() + comm->timeout_s;
      continue;
    }
    if (peer_gone || fake_now() > deadline) fake_comm_failed(comm, kNcclRemoteError);
    fake_wait_word(bell, rung, WAIT_SLICE_US);
  }
}
