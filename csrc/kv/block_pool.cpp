#include "kv/block_pool.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace pyserve {

BlockPool::BlockPool(int64_t num_blocks, BlockOrder order)
    : ref_counts_(num_blocks < 0 ? 0 : num_blocks, 0),
      prev_(num_blocks + 1),
      next_(num_blocks + 1),
      sentinel_(num_blocks),
      block_hash_(num_blocks < 0 ? 0 : num_blocks) {
  if (num_blocks <= 0) throw std::invalid_argument("BlockPool needs at least one block");
  prev_[sentinel_] = next_[sentinel_] = sentinel_;
  if (order == BlockOrder::kLru) {
    for (int64_t id = 0; id < num_blocks; ++id) push_tail(id);
  } else {
    num_free_ = num_blocks;  // all never used, none queued
  }
}

void BlockPool::check_id(int64_t block_id) const {
  if (block_id < 0 || block_id >= num_blocks())
    throw std::out_of_range("block id " + std::to_string(block_id) + " outside the pool of " +
                            std::to_string(num_blocks()));
}

void BlockPool::push_tail(int64_t id) {
  const int64_t last = prev_[sentinel_];
  prev_[id] = last;
  next_[id] = sentinel_;
  next_[last] = id;
  prev_[sentinel_] = id;
  ++num_free_;
}

void BlockPool::unlink(int64_t id) {
  next_[prev_[id]] = next_[id];
  prev_[next_[id]] = prev_[id];
  prev_[id] = next_[id] = -1;
  --num_free_;
}

std::vector<int64_t> BlockPool::allocate(int64_t n) {
  if (n < 0) throw std::invalid_argument("cannot allocate a negative number of blocks");
  if (n > num_free_)
    throw std::runtime_error("out of KV blocks: asked for " + std::to_string(n) + ", " +
                             std::to_string(num_free_) + " free");
  std::vector<int64_t> ids;
  ids.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    int64_t id = next_[sentinel_];
    if (id != sentinel_) {
      unlink(id);
    } else {  // the queue is empty (kResident): a block never used before
      id = next_unused_;
      --num_free_;
    }
    next_unused_ = std::max(next_unused_, id + 1);
    ref_counts_[id] = 1;
    if (!block_hash_[id].empty()) {  // reused for new content: its old entry goes
      cached_.erase(block_hash_[id]);
      block_hash_[id].clear();
      ++num_evictions_;
    }
    ids.push_back(id);
  }
  return ids;
}

void BlockPool::free(const std::vector<int64_t>& block_ids) {
  // Validate everything first so that a bad list changes nothing; a block listed more often
  // than it is held is a double free too.
  std::unordered_map<int64_t, int32_t> drops;
  for (int64_t id : block_ids) {
    check_id(id);
    if (++drops[id] > ref_counts_[id])
      throw std::runtime_error("double free of KV block " + std::to_string(id));
  }
  for (int64_t id : block_ids) {
    if (--ref_counts_[id] == 0) push_tail(id);
  }
}

void BlockPool::incref(const std::vector<int64_t>& block_ids) {
  for (int64_t id : block_ids) {
    check_id(id);
    if (ref_counts_[id] <= 0)
      throw std::runtime_error("incref of free KV block " + std::to_string(id));
  }
  for (int64_t id : block_ids) ++ref_counts_[id];
}

int64_t BlockPool::lookup(const std::string& hash) const {
  const auto it = cached_.find(hash);
  return it == cached_.end() ? -1 : it->second;
}

void BlockPool::acquire(const std::vector<int64_t>& block_ids) {
  for (int64_t id : block_ids) {
    check_id(id);
    if (block_hash_[id].empty())
      throw std::runtime_error("acquire of KV block " + std::to_string(id) + " that is not cached");
  }
  for (int64_t id : block_ids) {
    if (ref_counts_[id]++ == 0) unlink(id);
  }
}

bool BlockPool::cache(int64_t block_id, const std::string& hash) {
  check_id(block_id);
  if (ref_counts_[block_id] <= 0)
    throw std::runtime_error("cannot cache free KV block " + std::to_string(block_id));
  if (hash.empty()) throw std::invalid_argument("empty block hash");
  if (!block_hash_[block_id].empty()) return block_hash_[block_id] == hash;
  if (!cached_.emplace(hash, block_id).second) return false;
  block_hash_[block_id] = hash;
  return true;
}

int32_t BlockPool::ref_count(int64_t block_id) const {
  check_id(block_id);
  return ref_counts_[block_id];
}

std::vector<int64_t> BlockPool::free_queue() const {
  std::vector<int64_t> ids;
  ids.reserve(num_free_);
  for (int64_t id = next_[sentinel_]; id != sentinel_; id = next_[id]) ids.push_back(id);
  if (ids.size() < static_cast<size_t>(num_free_))  // kResident's never-used blocks
    for (int64_t id = next_unused_; id < num_blocks(); ++id) ids.push_back(id);
  return ids;
}

}  // namespace pyserve
