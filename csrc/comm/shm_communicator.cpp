#include "comm/shm_communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <stdexcept>

#include <ATen/Dispatch.h>

namespace pyserve {

namespace {

constexpr uint64_t kMagic = 0x7079736572766531ULL;  // "pyserve1"
constexpr int64_t kMaxRanks = 64;
constexpr int kSpinsBeforeSleep = 4000;
constexpr long kSleepNanos = 50'000'000;  // wake at least every 50 ms to look for aborts

struct alignas(64) Counter {
  std::atomic<uint64_t> value;
};

}  // namespace

struct ShmHeader {
  uint64_t magic;
  int64_t world_size;
  int64_t slot_bytes;
  alignas(64) std::atomic<uint32_t> aborted;
  std::atomic<uint32_t> wake_sequence;  // the futex word: bumped by every arrival
  std::atomic<uint32_t> sleepers;
  Counter arrived[kMaxRanks];
};

namespace {

constexpr size_t kDataOffset = (sizeof(ShmHeader) + 4095) / 4096 * 4096;

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  timespec timeout{0, kSleepNanos};
  // Not FUTEX_PRIVATE: the word is shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &timeout, nullptr, 0);
}

void futex_wake_all(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

[[noreturn]] void fail_errno(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

void check_host_contiguous(const torch::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), "ShmCommunicator.", op, ": tensor must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), "ShmCommunicator.", op, ": tensor must be contiguous");
}

}  // namespace

ShmCommunicator::ShmCommunicator(const std::string& name, int64_t rank, int64_t world_size,
                                 int64_t slot_bytes, bool create)
    : name_(name), rank_(rank), world_size_(world_size),
      slot_bytes_((slot_bytes + 63) / 64 * 64), owner_(create), linked_(create),
      parent_pid_(create ? 0 : getppid()) {
  TORCH_CHECK(world_size >= 1 && world_size <= kMaxRanks, "world_size must be in [1, ", kMaxRanks, "]");
  TORCH_CHECK(rank >= 0 && rank < world_size, "rank must be in [0, world_size)");
  TORCH_CHECK(slot_bytes_ > 0, "slot_bytes must be positive");
  mapped_bytes_ = kDataOffset + static_cast<size_t>(world_size * slot_bytes_);
  int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                  : shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) fail_errno("shm_open(" + name + ")");
  if (create && ftruncate(fd, static_cast<off_t>(mapped_bytes_)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    fail_errno("ftruncate(" + name + ")");
  }
  struct stat st{};
  if (!create && (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != mapped_bytes_)) {
    close(fd);
    throw std::runtime_error("shared-memory segment " + name + " has the wrong size");
  }
  void* base = mmap(nullptr, mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) {
    if (create) shm_unlink(name.c_str());
    fail_errno("mmap(" + name + ")");
  }
  header_ = static_cast<ShmHeader*>(base);
  data_ = static_cast<uint8_t*>(base) + kDataOffset;
  if (create) {  // ftruncate zero-filled the counters
    header_->world_size = world_size;
    header_->slot_bytes = slot_bytes_;
    std::atomic_thread_fence(std::memory_order_release);
    header_->magic = kMagic;
  } else if (header_->magic != kMagic || header_->world_size != world_size ||
             header_->slot_bytes != slot_bytes_) {
    munmap(base, mapped_bytes_);
    throw std::runtime_error("shared-memory segment " + name + " does not match this communicator");
  }
}

ShmCommunicator::~ShmCommunicator() {
  if (header_ != nullptr) munmap(header_, mapped_bytes_);
  if (owner_ && linked_) shm_unlink(name_.c_str());
}

void ShmCommunicator::unlink() {
  if (owner_ && linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void ShmCommunicator::abort() {
  header_->aborted.store(1, std::memory_order_seq_cst);
  header_->wake_sequence.fetch_add(1, std::memory_order_seq_cst);
  futex_wake_all(&header_->wake_sequence);
}

bool ShmCommunicator::aborted() const { return header_->aborted.load(std::memory_order_relaxed) != 0; }

void ShmCommunicator::wait_for(uint64_t generation) {
  auto everyone_arrived = [&] {
    for (int64_t r = 0; r < world_size_; ++r)
      if (header_->arrived[r].value.load(std::memory_order_acquire) < generation) return false;
    return true;
  };
  int spins = 0;
  while (!everyone_arrived()) {
    if (aborted()) throw std::runtime_error("tensor-parallel communicator aborted: a rank is gone");
    if (++spins < kSpinsBeforeSleep) {
      cpu_relax();
      continue;
    }
    // A sleeper registers before reading the futex word; an arriving rank bumps the word
    // before reading the sleeper count, so one of the two always sees the other.
    header_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    uint32_t seen = header_->wake_sequence.load(std::memory_order_seq_cst);
    if (!everyone_arrived() && !aborted()) futex_wait(&header_->wake_sequence, seen);
    header_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (parent_pid_ != 0 && getppid() != parent_pid_)
      throw std::runtime_error("tensor-parallel rank 0 is gone");
  }
}

void ShmCommunicator::sync() {
  if (aborted()) throw std::runtime_error("tensor-parallel communicator aborted: a rank is gone");
  ++generation_;
  header_->arrived[rank_].value.store(generation_, std::memory_order_release);
  header_->wake_sequence.fetch_add(1, std::memory_order_seq_cst);
  if (header_->sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&header_->wake_sequence);
  wait_for(generation_);
}

void ShmCommunicator::barrier() { sync(); }

template <typename Fn>
void ShmCommunicator::for_each_chunk(int64_t total_bytes, Fn&& fn) {
  // Every rank walks the same chunks, so an empty tensor still meets the others once.
  int64_t offset = 0;
  do {
    int64_t len = std::min(slot_bytes_, total_bytes - offset);
    fn(offset, len);
    offset += len;
  } while (offset < total_bytes);
}

void ShmCommunicator::all_reduce(torch::Tensor& tensor) {
  check_host_contiguous(tensor, "all_reduce");
  if (world_size_ == 1) return;
  const int64_t elem = tensor.element_size();
  auto* bytes = static_cast<uint8_t*>(tensor.data_ptr());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, tensor.scalar_type(), "shm_all_reduce", [&] {
    for_each_chunk(tensor.numel() * elem, [&](int64_t offset, int64_t len) {
      std::memcpy(slot(rank_), bytes + offset, len);
      sync();
      auto* out = reinterpret_cast<scalar_t*>(bytes + offset);
      const int64_t n = len / elem;
      for (int64_t i = 0; i < n; ++i) {
        float acc = static_cast<float>(reinterpret_cast<const scalar_t*>(slot(0))[i]);
        for (int64_t r = 1; r < world_size_; ++r)
          acc += static_cast<float>(reinterpret_cast<const scalar_t*>(slot(r))[i]);
        out[i] = static_cast<scalar_t>(acc);
      }
      sync();
    });
  });
}

torch::Tensor ShmCommunicator::collect(const torch::Tensor& tensor, int64_t root, const char* op) {
  check_host_contiguous(tensor, op);
  TORCH_CHECK(root >= -1 && root < world_size_, op, ": root out of range");
  const bool receives = root == -1 || rank_ == root;
  std::vector<int64_t> shape{world_size_};
  for (auto d : tensor.sizes()) shape.push_back(d);
  auto out = receives ? torch::empty(shape, tensor.options()) : torch::empty({0}, tensor.options());
  const int64_t total = tensor.numel() * tensor.element_size();
  auto* src = static_cast<const uint8_t*>(tensor.data_ptr());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for_each_chunk(total, [&](int64_t offset, int64_t len) {
    std::memcpy(slot(rank_), src + offset, len);
    sync();
    if (receives)
      for (int64_t r = 0; r < world_size_; ++r) std::memcpy(dst + r * total + offset, slot(r), len);
    sync();
  });
  return out;
}

torch::Tensor ShmCommunicator::all_gather(const torch::Tensor& tensor) {
  return collect(tensor, -1, "all_gather");
}

torch::Tensor ShmCommunicator::gather(const torch::Tensor& tensor, int64_t root) {
  TORCH_CHECK(root >= 0, "gather: root out of range");
  return collect(tensor, root, "gather");
}

void ShmCommunicator::broadcast(torch::Tensor& tensor, int64_t root) {
  check_host_contiguous(tensor, "broadcast");
  TORCH_CHECK(root >= 0 && root < world_size_, "broadcast: root out of range");
  if (world_size_ == 1) return;
  auto* bytes = static_cast<uint8_t*>(tensor.data_ptr());
  for_each_chunk(tensor.numel() * tensor.element_size(), [&](int64_t offset, int64_t len) {
    if (rank_ == root) std::memcpy(slot(root), bytes + offset, len);
    sync();
    if (rank_ != root) std::memcpy(bytes + offset, slot(root), len);
    sync();
  });
}

std::vector<torch::Tensor> ShmCommunicator::broadcast_tensors(
    const std::vector<torch::Tensor>& tensors, int64_t root) {
  TORCH_CHECK(root >= 0 && root < world_size_, "broadcast_tensors: root out of range");
  // The message: [total bytes, count, size of each], then each tensor's bytes.
  std::vector<uint8_t> message;
  if (rank_ == root) {
    std::vector<uint64_t> head{0, tensors.size()};
    uint64_t body = 0;
    for (const auto& t : tensors) {
      check_host_contiguous(t, "broadcast_tensors");
      head.push_back(t.numel() * t.element_size());
      body += head.back();
    }
    head[0] = head.size() * sizeof(uint64_t) + body;
    TORCH_CHECK(head.size() * sizeof(uint64_t) <= static_cast<size_t>(slot_bytes_),
                "broadcast_tensors: too many tensors for one slot");
    message.resize(head[0]);
    std::memcpy(message.data(), head.data(), head.size() * sizeof(uint64_t));
    size_t at = head.size() * sizeof(uint64_t);
    for (const auto& t : tensors) {
      std::memcpy(message.data() + at, t.data_ptr(), t.numel() * t.element_size());
      at += t.numel() * t.element_size();
    }
  }
  if (world_size_ > 1) {
    uint64_t total = message.size();
    uint64_t offset = 0;
    do {  // the first chunk tells the receivers the total
      uint64_t len = 0;
      if (rank_ == root) {
        len = std::min<uint64_t>(slot_bytes_, total - offset);
        std::memcpy(slot(root), message.data() + offset, len);
      }
      sync();
      if (rank_ != root) {
        if (offset == 0) {
          std::memcpy(&total, slot(root), sizeof(total));
          message.resize(total);
        }
        len = std::min<uint64_t>(slot_bytes_, total - offset);
        std::memcpy(message.data() + offset, slot(root), len);
      }
      sync();
      offset += len;
    } while (offset < total);
  }
  const auto* head = reinterpret_cast<const uint64_t*>(message.data());
  const uint64_t count = head[1];
  std::vector<torch::Tensor> out;
  size_t at = (2 + count) * sizeof(uint64_t);
  for (uint64_t i = 0; i < count; ++i) {
    auto t = torch::empty({static_cast<int64_t>(head[2 + i])}, torch::kUInt8);
    std::memcpy(t.data_ptr(), message.data() + at, head[2 + i]);
    at += head[2 + i];
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace pyserve
