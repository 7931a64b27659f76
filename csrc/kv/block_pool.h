// The pool of KV-cache blocks: which block ids are free, and how many holders each has.
//
// Invariants:
//  * every block id in [0, num_blocks) is either in the free queue (ref count 0) or held
//    (ref count >= 1), never both;
//  * the free queue is ordered by release time: allocate() takes from the head, the oldest
//    released block, and free() appends at the tail. A block that later carries a prefix-cache
//    entry can be pulled out of the middle in O(1) (doubly linked), so eviction stays LRU.
#pragma once

#include <cstdint>
#include <vector>

namespace pyserve {

class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks);

  // Takes n blocks off the head of the free queue, each with ref count 1.
  // Throws std::runtime_error (and takes nothing) if fewer than n are free.
  std::vector<int64_t> allocate(int64_t n);
  // Drops one reference from each block; a block whose count reaches 0 joins the free queue's
  // tail in the order given. Throws on an unknown or already free block (a double free).
  void free(const std::vector<int64_t>& block_ids);
  // Adds a holder to blocks already held (sharing).
  void incref(const std::vector<int64_t>& block_ids);

  int64_t num_blocks() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t num_free() const { return num_free_; }
  int32_t ref_count(int64_t block_id) const;
  // Free block ids, head (next to be allocated) first; for tests and debugging.
  std::vector<int64_t> free_queue() const;

 private:
  void check_id(int64_t block_id) const;
  void push_tail(int64_t block_id);
  void unlink(int64_t block_id);

  std::vector<int32_t> ref_counts_;
  // Doubly linked free queue over block ids; index num_blocks is the sentinel.
  std::vector<int64_t> prev_;
  std::vector<int64_t> next_;
  int64_t sentinel_;
  int64_t num_free_ = 0;
};

}  // namespace pyserve
