#pragma once
// The one place where LibTorch 2.x releases differ for us (supported: 2.4 through the pinned 2.11,
// and the later 2.x headers as far as they were read). Differences are chosen by traits on the
// signatures where a signature changed, by version only where a behaviour did.
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/version.h>

#define TRAINSCOPE_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

#if !TRAINSCOPE_TORCH_AT_LEAST(2, 4)
#error "trainscope needs LibTorch 2.4 or newer"
#endif

namespace trainscope::compat {

// Autocast for one forward pass, like Python's `torch.autocast` context manager. On exit it restores
// the previous state and, when the outermost autocast region closes, clears the cast cache: without
// that, the next forward after an optimizer step would use stale low-precision copies of the weights.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, at::ScalarType dtype, bool enabled = true)
      : device_(device), active_(enabled) {
    if (!active_) return;
    prev_enabled_ = at::autocast::is_autocast_enabled(device_);
    prev_dtype_ = at::autocast::get_autocast_dtype(device_);
    at::autocast::set_autocast_dtype(device_, dtype);
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!active_) return;
    at::autocast::set_autocast_dtype(device_, prev_dtype_);
    at::autocast::set_autocast_enabled(device_, prev_enabled_);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool active_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

inline bool autocast_enabled(c10::DeviceType d) { return at::autocast::is_autocast_enabled(d); }
inline at::ScalarType autocast_dtype(c10::DeviceType d) { return at::autocast::get_autocast_dtype(d); }

}  // namespace trainscope::compat

namespace trainscope::compat {

// c10d: ProcessGroupGloo/NCCL are Backends that a dispatching ProcessGroup wraps; the ProcessGroup
// constructor lost its Options argument around 2.6 (chosen by a trait). A template, so that only the
// file that includes the c10d headers instantiates it.
template <typename ProcessGroup, typename Backend, typename Store>
c10::intrusive_ptr<ProcessGroup> as_process_group(const c10::intrusive_ptr<Backend>& backend,
                                                  const c10::intrusive_ptr<Store>& store, int rank, int size,
                                                  bool nccl) {
  const auto type = nccl ? ProcessGroup::BackendType::NCCL : ProcessGroup::BackendType::GLOO;
  c10::intrusive_ptr<ProcessGroup> pg;
  if constexpr (std::is_constructible_v<ProcessGroup, c10::intrusive_ptr<Store>, int, int>)
    pg = c10::make_intrusive<ProcessGroup>(store, rank, size);
  else
    pg = c10::make_intrusive<ProcessGroup>(
        store, rank, size, c10::make_intrusive<typename ProcessGroup::Options>(nccl ? "nccl" : "gloo"));
  pg->setBackend(nccl ? c10::DeviceType::CUDA : c10::DeviceType::CPU, type, backend);
  pg->setDefaultBackend(type);
  return pg;
}

// Flat all-gather and reduce-scatter: `_allgather_base` / `_reduce_scatter_base` up to 2.13; from
// about 2.14 `all_gather_single` / `reduce_scatter_single` are the names and the old ones deprecated
// forwarders. Chosen by whether the new member exists.
template <typename PG, typename = void>
struct has_all_gather_single : std::false_type {};
template <typename PG>
struct has_all_gather_single<PG, std::void_t<decltype(std::declval<PG&>().all_gather_single(
                                     std::declval<at::Tensor&>(), std::declval<at::Tensor&>()))>> : std::true_type {};

template <typename PG>
auto all_gather_single(PG& pg, at::Tensor& out, at::Tensor& in) {
  if constexpr (has_all_gather_single<PG>::value)
    return pg.all_gather_single(out, in);
  else
    return pg._allgather_base(out, in);
}

template <typename PG, typename Opts>
auto reduce_scatter_single(PG& pg, at::Tensor& out, at::Tensor& in, const Opts& opts) {
  if constexpr (has_all_gather_single<PG>::value)
    return pg.reduce_scatter_single(out, in, opts);
  else
    return pg._reduce_scatter_base(out, in, opts);
}

// c10d::Reducer's constructor gained arguments across 2.x: (..., first_bucket_bytes_cap) up to about
// 2.7, then skip_all_reduce_unused_params and use_python_reducer (~2.8), a per-bucket cap list (2.11)
// and batched_grad_copy (later). Chosen by a trait on the constructor. A template, so that only its
// user includes reducer.hpp.
template <typename Reducer, typename ProcessGroupPtr>
std::unique_ptr<Reducer> make_reducer(std::vector<at::Tensor> params, std::vector<std::vector<size_t>> indices,
                                      ProcessGroupPtr pg, std::vector<bool> sparse, int64_t cap, bool find_unused,
                                      bool as_view, std::unordered_map<size_t, std::string> names,
                                      int64_t first_cap) {
  using P = std::vector<at::Tensor>;
  using I = std::vector<std::vector<size_t>>;
  using S = std::vector<bool>;
  using N = std::unordered_map<size_t, std::string>;
  using Caps = std::vector<int64_t>;
  if constexpr (std::is_constructible_v<Reducer, P, I, ProcessGroupPtr, S, int64_t, bool, bool, N, int64_t>) {
    return std::make_unique<Reducer>(std::move(params), std::move(indices), std::move(pg), std::move(sparse), cap,
                                     find_unused, as_view, std::move(names), first_cap);
  } else if constexpr (std::is_constructible_v<Reducer, P, I, ProcessGroupPtr, S, int64_t, bool, bool, N, int64_t,
                                               bool, bool>) {
    return std::make_unique<Reducer>(std::move(params), std::move(indices), std::move(pg), std::move(sparse), cap,
                                     find_unused, as_view, std::move(names), first_cap, false, false);
  } else if constexpr (std::is_constructible_v<Reducer, P, I, ProcessGroupPtr, S, int64_t, bool, bool, N, int64_t,
                                               bool, bool, Caps>) {
    return std::make_unique<Reducer>(std::move(params), std::move(indices), std::move(pg), std::move(sparse), cap,
                                     find_unused, as_view, std::move(names), first_cap, false, false, Caps{});
  } else {
    return std::make_unique<Reducer>(std::move(params), std::move(indices), std::move(pg), std::move(sparse), cap,
                                     find_unused, as_view, std::move(names), first_cap, false, false, Caps{}, false);
  }
}

}  // namespace trainscope::compat
