// The pool of KV-cache blocks: which block ids are free, and how many holders each has.
//
// Invariants:
//  * every block id in [0, num_blocks) is exactly one of: held (ref count >= 1), in the free
//    queue (ref count 0), or never used (kResident only: ref count 0, no hash, not queued);
//  * the free queue is ordered by release time: allocate() takes from the head, the oldest
//    released block, and free() appends at the tail;
//  * the pool starts in one of two orders. kLru (vLLM's): every block starts in the free queue,
//    so each block is used once before any cached content is evicted: the prefix cache keeps
//    the most, and all of the cache's memory is written. kResident: blocks never used wait
//    behind the free queue and are taken only when it is empty, so a new block reuses memory
//    already written (evicting the least recently released cached content) and the memory
//    the cache touches grows with the most blocks ever held at once, not with the pool;
//  * prefix cache: a full block may carry a content hash (a chained SHA-256 computed by the
//    caller, 32 bytes, strong enough that collisions are no practical risk, so hits are not
//    re-verified). A hash maps to at most one block. A cached block keeps its hash while free,
//    so a later request can take it back out of the middle of the free queue (O(1), doubly
//    linked); only when allocate() reuses it for new content is the entry evicted. Eviction is
//    therefore least-recently-released first.
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace pyserve {

enum class BlockOrder { kLru, kResident };

class BlockPool {
 public:
  explicit BlockPool(int64_t num_blocks, BlockOrder order = BlockOrder::kLru);

  // Takes n blocks off the head of the free queue (then never-used ones), each with ref count 1.
  // Throws std::runtime_error (and takes nothing) if fewer than n are free.
  std::vector<int64_t> allocate(int64_t n);
  // Drops one reference from each block; a block whose count reaches 0 joins the free queue's
  // tail in the order given. Throws on an unknown or already free block (a double free).
  void free(const std::vector<int64_t>& block_ids);
  // Adds a holder to blocks already held (sharing).
  void incref(const std::vector<int64_t>& block_ids);

  // Prefix cache. lookup: the block holding this content, or -1.
  int64_t lookup(const std::string& hash) const;
  // Takes a reference on cache hits, pulling free ones out of the free queue.
  void acquire(const std::vector<int64_t>& block_ids);
  // Records that the held block block_id now holds full content with this hash. Returns false
  // (and records nothing) when another block already holds the same content.
  bool cache(int64_t block_id, const std::string& hash);
  int64_t num_cached() const { return static_cast<int64_t>(cached_.size()); }
  int64_t num_evictions() const { return num_evictions_; }

  int64_t num_blocks() const { return static_cast<int64_t>(ref_counts_.size()); }
  int64_t num_free() const { return num_free_; }
  int32_t ref_count(int64_t block_id) const;
  // Free block ids, head (next to be allocated) first, then kResident's never-used ones;
  // for tests and debugging.
  std::vector<int64_t> free_queue() const;
  // Blocks ever allocated: those whose memory the cache has written.
  int64_t num_touched() const { return next_unused_; }

 private:
  void check_id(int64_t block_id) const;
  void push_tail(int64_t block_id);
  void unlink(int64_t block_id);

  std::vector<int32_t> ref_counts_;
  // Doubly linked free queue over block ids; index num_blocks is the sentinel.
  std::vector<int64_t> prev_;
  std::vector<int64_t> next_;
  int64_t sentinel_;
  int64_t num_free_ = 0;  // in the queue, plus the never-used blocks behind it
  int64_t next_unused_ = 0;  // blocks [next_unused_, num_blocks) have never been allocated
  std::unordered_map<std::string, int64_t> cached_;
  std::vector<std::string> block_hash_;  // empty: the block carries no cache entry
  int64_t num_evictions_ = 0;
};

}  // namespace pyserve
