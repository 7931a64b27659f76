// Collectives among the tensor-parallel ranks of one machine, over one shared-memory segment.
//
// Each rank owns a slot of slot_bytes. An operation copies this rank's part into its slot,
// meets the other ranks at a barrier, reads what it needs from the slots, and meets them
// again so that no rank overwrites its slot while a slower one still reads it. Tensors larger
// than a slot go through in chunks. Reductions add the slots in rank order on every rank, so
// all ranks hold bitwise-identical sums.
//
// The barrier is a per-rank generation counter: a rank arrives by publishing its generation
// and waits until every rank has published at least that generation. Waiting spins briefly
// (a step's collectives follow each other within microseconds), then sleeps on a futex in
// the segment so that idle ranks cost nothing. abort() (from a rank that saw a peer die)
// makes every waiting and later operation on every rank throw instead of hanging; a rank
// whose parent process is gone throws too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/types.h>

namespace pyserve {

struct ShmHeader;

class ShmCommunicator {
 public:
  // rank 0 creates the segment (create=true); the others attach to it by name.
  ShmCommunicator(const std::string& name, int64_t rank, int64_t world_size, int64_t slot_bytes,
                  bool create);
  ~ShmCommunicator();
  ShmCommunicator(const ShmCommunicator&) = delete;
  ShmCommunicator& operator=(const ShmCommunicator&) = delete;

  void all_reduce(torch::Tensor& tensor);                       // in-place sum
  torch::Tensor all_gather(const torch::Tensor& tensor);        // -> [world, *shape]
  torch::Tensor gather(const torch::Tensor& tensor, int64_t root);  // root: [world, *shape]
  void broadcast(torch::Tensor& tensor, int64_t root);          // in place
  // root sends its tensors' bytes as one message; every rank returns them as uint8 tensors
  // (the receivers need not know the sizes beforehand). Two meetings for a small message.
  std::vector<torch::Tensor> broadcast_tensors(const std::vector<torch::Tensor>& tensors,
                                               int64_t root);
  void barrier();
  void abort();
  bool aborted() const;
  // Removes the segment's name; mappings stay valid. Called once every rank has attached, so
  // no name outlives the processes however they end.
  void unlink();

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  const std::string& name() const { return name_; }

 private:
  void sync();  // arrive at the next generation and wait for every rank
  void wait_for(uint64_t generation);
  // every rank's tensor, stacked, on root (or on every rank when root is -1)
  torch::Tensor collect(const torch::Tensor& tensor, int64_t root, const char* op);
  uint8_t* slot(int64_t r) const { return data_ + r * slot_bytes_; }
  template <typename Fn>
  void for_each_chunk(int64_t total_bytes, Fn&& fn);

  std::string name_;
  int64_t rank_;
  int64_t world_size_;
  int64_t slot_bytes_;
  bool owner_;
  bool linked_;
  int parent_pid_;  // workers: the pid of rank 0, whose death ends every wait
  size_t mapped_bytes_ = 0;
  ShmHeader* header_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t generation_ = 0;
};

}  // namespace pyserve
