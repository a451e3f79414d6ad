// Node-based maps allocate a node per insert and free it per erase. The runtime inserts and
// erases a few entries per tensor, and on shared memory a small collective costs ~2 us, so
// erased nodes are kept here and reused by the next inserts instead of going back to malloc.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace commsched {

template <typename Map>
class NodeRecycler {
 public:
  using Key = typename Map::key_type;
  using Mapped = typename Map::mapped_type;

  explicit NodeRecycler(size_t keep = 64) : keep_(keep) {}

  // Like map.try_emplace(key, value): inserts when the key is absent, else returns the entry there.
  std::pair<typename Map::iterator, bool> try_insert(Map& map, const Key& key, Mapped value) {
    if (spares_.empty()) return map.try_emplace(key, std::move(value));
    auto found = map.find(key);
    if (found != map.end()) return {found, false};
    typename Map::node_type node = std::move(spares_.back());
    spares_.pop_back();
    node.key() = key;
    node.mapped() = std::move(value);
    auto result = map.insert(std::move(node));
    return {result.position, result.inserted};
  }

  // Like map.erase(it), keeping the node (its mapped value reset) for a later insert.
  void erase(Map& map, typename Map::iterator it) {
    typename Map::node_type node = map.extract(it);
    if (spares_.size() >= keep_) return;
    node.mapped() = Mapped{};
    spares_.push_back(std::move(node));
  }

 private:
  size_t keep_;
  std::vector<typename Map::node_type> spares_;
};

}  // namespace commsched
