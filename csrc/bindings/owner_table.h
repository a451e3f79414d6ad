// Keeps the Python objects that own the memory of collectives in flight alive until they finish,
// whether or not anyone still holds their handles: a caller may drop both the array and the
// handle while the core still writes into the array.
//
// Used only from Python threads with the GIL held. The core's thread never holds a Python
// reference, so it never needs the GIL, and nothing can deadlock on it at shutdown or exit;
// finished owners are released here, on the next Python call that prunes.
#pragma once

#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "core/handle.h"

namespace commsched {

class OwnerTable {
 public:
  OwnerTable() = default;
  OwnerTable(const OwnerTable&) = delete;
  OwnerTable& operator=(const OwnerTable&) = delete;
  ~OwnerTable() {
    // Destroyed with the module, normally with the interpreter still up. If it is not, the
    // references cannot be dropped safely any more: leave them to the process's end.
    if (!Py_IsInitialized()) {
      for (auto& entry : entries_) entry.second.release();
    }
  }

  // Holds `owner` until `handle` is done. Prunes now and then, so the table stays about as
  // large as what is in flight.
  void keep(std::shared_ptr<HandleState> handle, pybind11::object owner) {
    if (handle->done()) return;
    entries_.emplace_back(std::move(handle), std::move(owner));
    if (entries_.size() >= prune_at_) {
      prune();
      prune_at_ = std::max(kMinPruneAt, 2 * entries_.size());
    }
  }

  // Releases the owners of finished collectives.
  void prune() {
    // The owners go only once the table is whole again: releasing one may run Python code (a
    // finalizer, a weakref callback) or let another thread take the GIL, and either may submit or
    // wait on a collective and so keep or prune here. Releasing them from inside the compaction
    // corrupted the heap.
    std::vector<pybind11::object> finished;
    size_t kept = 0;
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (entries_[i].first->done()) {
        finished.push_back(std::move(entries_[i].second));
      } else {
        // Every slot written to was emptied first (moved from): the assignment releases nothing.
        if (kept != i) entries_[kept] = std::move(entries_[i]);
        ++kept;
      }
    }
    entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(kept), entries_.end());
  }  // `finished` releases the owners here

  // Owners still held once finished ones are released.
  size_t held() {
    prune();
    return entries_.size();
  }

 private:
  static constexpr size_t kMinPruneAt = 64;
  std::vector<std::pair<std::shared_ptr<HandleState>, pybind11::object>> entries_;
  size_t prune_at_ = kMinPruneAt;
};

}  // namespace commsched
