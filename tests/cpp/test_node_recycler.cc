// The runtime's map-node reuse: entries behave as with plain try_emplace / erase.
#include <string>
#include <unordered_map>

#include "check.h"
#include "core/node_recycler.h"

using namespace commsched;

TEST_CASE(recycled_nodes_insert_find_and_refuse_duplicates_like_the_map) {
  std::unordered_map<std::string, int> map;
  NodeRecycler<std::unordered_map<std::string, int>> nodes(2);
  EXPECT(nodes.try_insert(map, "a", 1).second);
  EXPECT(!nodes.try_insert(map, "a", 5).second);
  EXPECT_EQ(map.at("a"), 1);
  nodes.erase(map, map.find("a"));
  EXPECT(map.empty());
  // The kept node comes back under a new key, its old value gone.
  auto [it, inserted] = nodes.try_insert(map, "b", 2);
  EXPECT(inserted);
  EXPECT_EQ(it->first, std::string("b"));
  EXPECT_EQ(map.at("b"), 2);
  EXPECT(!nodes.try_insert(map, "b", 3).second);
  EXPECT_EQ(map.at("b"), 2);
  EXPECT(nodes.try_insert(map, "c", 6).second);
  EXPECT_EQ(map.at("c"), 6);
  // Past `keep` spares, erased nodes are freed, and inserts still work.
  for (const char* key : {"b", "c"}) nodes.erase(map, map.find(key));
  for (int i = 0; i < 5; ++i) EXPECT(nodes.try_insert(map, "k" + std::to_string(i), i).second);
  for (int i = 0; i < 5; ++i) nodes.erase(map, map.find("k" + std::to_string(i)));
  EXPECT(map.empty());
  EXPECT(nodes.try_insert(map, "z", 9).second);
  EXPECT_EQ(map.size(), 1u);
}
