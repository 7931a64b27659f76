// The one pybind11 module, pyserve._C. Ops are chosen by the device of their tensors; Python
// reaches them only through pyserve/_native.py.
#include <torch/extension.h>

#include "comm/shm_communicator.h"
#include "cpu/ops.h"
#include "kv/block_pool.h"
#ifdef PYSERVE_CUDA
#include "cuda/nccl_communicator.h"
#include "cuda/ops.h"
#endif

namespace pyserve {
namespace {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                       at::Tensor& value_cache, const at::Tensor& slot_mapping) {
#ifdef PYSERVE_CUDA
  if (key.is_cuda()) {
    TORCH_CHECK(key_cache.device() == key.device() && slot_mapping.device() == key.device(),
                "reshape_and_cache: all tensors must be on one device");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong, "slot_mapping must be int64");
    return cuda::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
  }
#endif
  TORCH_CHECK(key.device().is_cpu(), "reshape_and_cache: no kernel for device ", key.device());
  cpu::reshape_and_cache(key, value, key_cache, value_cache, slot_mapping);
}

void paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(query.device().is_cpu(), "paged_attention: no kernel for device ", query.device());
  cpu::paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                       scale);
}

bool built_with_cuda() {
#ifdef PYSERVE_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace pyserve

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  using pyserve::BlockPool;
  m.doc() = "pyserve native core: KV block pool and attention kernels";

  py::class_<BlockPool>(m, "BlockPool")
      .def(py::init<int64_t>(), py::arg("num_blocks"))
      .def("allocate", &BlockPool::allocate, py::arg("n"))
      .def("free", &BlockPool::free, py::arg("block_ids"))
      .def("incref", &BlockPool::incref, py::arg("block_ids"))
      .def("ref_count", &BlockPool::ref_count, py::arg("block_id"))
      .def("free_queue", &BlockPool::free_queue)
      .def("lookup", [](const BlockPool& p, py::bytes hash) { return p.lookup(std::string(hash)); },
           py::arg("block_hash"))
      .def("acquire", &BlockPool::acquire, py::arg("block_ids"))
      .def("cache", [](BlockPool& p, int64_t id, py::bytes hash) { return p.cache(id, std::string(hash)); },
           py::arg("block_id"), py::arg("block_hash"))
      .def_property_readonly("num_cached", &BlockPool::num_cached)
      .def_property_readonly("num_evictions", &BlockPool::num_evictions)
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("num_free", &BlockPool::num_free);

  m.def("reshape_and_cache", &pyserve::reshape_and_cache, py::arg("key"), py::arg("value"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("paged_attention", &pyserve::paged_attention, py::arg("out"), py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"),
        py::call_guard<py::gil_scoped_release>());
  m.def("linear", &pyserve::cpu::linear, py::arg("out"), py::arg("x"), py::arg("weight"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("built_with_cuda", &pyserve::built_with_cuda);

  // Collectives wait for the other ranks: they release the GIL so the rest of the process
  // (the event loop, a watchdog) keeps running meanwhile.
  using pyserve::ShmCommunicator;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<ShmCommunicator>(m, "ShmCommunicator")
      .def(py::init<const std::string&, int64_t, int64_t, int64_t, bool>(), py::arg("name"),
           py::arg("rank"), py::arg("world_size"), py::arg("slot_bytes"), py::arg("create"))
      .def("all_reduce", &ShmCommunicator::all_reduce, py::arg("tensor"), release())
      .def("all_gather", &ShmCommunicator::all_gather, py::arg("tensor"), release())
      .def("gather", &ShmCommunicator::gather, py::arg("tensor"), py::arg("root") = 0, release())
      .def("broadcast", &ShmCommunicator::broadcast, py::arg("tensor"), py::arg("root") = 0, release())
      .def("broadcast_tensors", &ShmCommunicator::broadcast_tensors, py::arg("tensors"),
           py::arg("root") = 0, release())
      .def("barrier", &ShmCommunicator::barrier, release())
      .def("abort", &ShmCommunicator::abort)
      .def("unlink", &ShmCommunicator::unlink)
      .def_property_readonly("aborted", &ShmCommunicator::aborted)
      .def_property_readonly("rank", &ShmCommunicator::rank)
      .def_property_readonly("world_size", &ShmCommunicator::world_size)
      .def_property_readonly("name", &ShmCommunicator::name);

#ifdef PYSERVE_NCCL
  using pyserve::cuda::NcclCommunicator;
  m.def("nccl_unique_id", [] { return py::bytes(pyserve::cuda::nccl_unique_id()); });
  py::class_<NcclCommunicator>(m, "NcclCommunicator")
      .def(py::init<const std::string&, int64_t, int64_t>(), py::arg("unique_id"), py::arg("rank"),
           py::arg("world_size"), release())
      .def("all_reduce", &NcclCommunicator::all_reduce, py::arg("tensor"), release())
      .def("all_gather", &NcclCommunicator::all_gather, py::arg("tensor"), release())
      .def("gather", &NcclCommunicator::gather, py::arg("tensor"), py::arg("root") = 0, release())
      .def("broadcast", &NcclCommunicator::broadcast, py::arg("tensor"), py::arg("root") = 0, release())
      .def("abort", &NcclCommunicator::abort)
      .def_property_readonly("rank", &NcclCommunicator::rank)
      .def_property_readonly("world_size", &NcclCommunicator::world_size);
#endif
  m.def("built_with_nccl", [] {
#ifdef PYSERVE_NCCL
    return true;
#else
    return false;
#endif
  });
}
