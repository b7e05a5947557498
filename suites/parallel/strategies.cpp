#include "suites/parallel/strategies.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <set>

#include "core/errors.hpp"
#include "suites/parallel/sharding.hpp"

namespace trainscope::suites {
namespace detail {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void release_storage(const torch::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  s->set_data_ptr(c10::DataPtr(nullptr, s->device()));
  s->set_nbytes(0);
}

void allocate_storage(const torch::Tensor& t) {
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  const size_t want = static_cast<size_t>(t.numel()) * t.element_size();
  if (s->nbytes() == want) return;
  s->set_data_ptr(s->allocator()->allocate(want));
  s->set_nbytes(want);
}

int64_t bytes_of(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}


torch::Tensor optimizer_slice(const torch::Tensor& data, bool share) {
  torch::Tensor t = share ? data.detach() : data.detach().clone();
  return t.requires_grad_(true);
}

void broadcast_buffers(Communicator& comm, ReferenceModel& model) {
  std::vector<torch::Tensor> bufs;
  for (const auto& b : model.buffers())
    if (b.is_floating_point()) bufs.push_back(b);
  if (!bufs.empty()) {
    torch::NoGradGuard no_grad;
    comm.broadcast(bufs, 0);
  }
}

// Reports a backward's bucket collectives once backward() has returned (having waited for every
// bucket). What came after the last launch (the last gradient ready) was the step waiting on
// communication: the exposed part, charged to the last bucket. On NCCL the host saw only launches:
// the durations wait for the device clock (Communicator::report_after), and the device timeline
// (`timeline = true`) has the exposed part.
void report_buckets(Communicator& comm, const std::string& op, std::vector<BucketRecord>& recs,
                    double backward_end) {
  double last_launch = 0, last_end = 0;
  for (const auto& r : recs) {
    last_launch = std::max(last_launch, r.start);
    last_end = std::max(last_end, r.end);
  }
  const double exposed = std::max(0.0, std::min(backward_end, last_end) - last_launch);
  for (size_t i = 0; i < recs.size(); ++i) {
    CollectiveInfo c{op, recs[i].bytes, comm.world_size(), std::max(0.0, recs[i].end - recs[i].start),
                     i + 1 == recs.size() ? exposed : 0.0, comm.step(), recs[i].end, "", ""};
    comm.report_after(c, std::move(recs[i].works));
  }
}

void zero_flat_gradients(FlatParams& fp, const torch::Tensor& shard) {
  torch::NoGradGuard no_grad;
  allocate_storage(fp.grad);
  fp.grad.zero_();
  shard.mutable_grad().zero_();
}

torch::Tensor flat_values(const std::vector<torch::Tensor>& ps, int world, at::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  int64_t numel = 0;
  for (const auto& p : ps) numel += p.numel();
  const int64_t padded = (numel + world - 1) / world * world;
  torch::Tensor flat = torch::zeros({padded}, ps.front().options().dtype(dtype));
  int64_t off = 0;
  for (const auto& p : ps) {
    flat.narrow(0, off, p.numel()).copy_(p.reshape(-1));
    off += p.numel();
  }
  return flat;
}

}  // namespace detail

namespace {

// One process: the parameters are the optimizer's, nothing to synchronise.
class Single : public ParallelStrategy {
 public:
  Single() : ParallelStrategy(nullptr) {}
  std::string sharding_level() const override { return "single"; }
  std::vector<torch::Tensor> setup(ReferenceModel& model, bool) override {
    model_ = &model;
    return model.parameters();
  }
};

}  // namespace

uint64_t fingerprint(const torch::Tensor& t, uint64_t h) {
  // An exact, order-independent hash computed where the tensor lives (no copy of a GPU model to the
  // host): the bytes as 32-bit words, two position-weighted sums in int64 arithmetic, which wraps mod
  // 2^64 the same way in any summation order. Chunked, so the int64 temporaries stay small.
  auto mix = [](uint64_t a, uint64_t b) {
    a ^= b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2);
    return a * 1099511628211ULL;
  };
  h = mix(h, t.defined() ? static_cast<uint64_t>(t.numel()) : ~0ULL);
  if (!t.defined() || t.numel() == 0) return h;
  torch::NoGradGuard no_grad;
  torch::Tensor bytes = t.detach().contiguous().reshape({-1}).view(torch::kUInt8);
  if (const int64_t pad = (4 - bytes.numel() % 4) % 4; pad > 0)
    bytes = torch::cat({bytes, torch::zeros({pad}, bytes.options())});
  const torch::Tensor words = bytes.view(torch::kInt);
  const int64_t n = words.numel(), chunk = int64_t{1} << 22;
  const auto opts = words.options().dtype(torch::kLong);
  torch::Tensor s1 = torch::zeros({}, opts), s2 = torch::zeros({}, opts);
  for (int64_t off = 0; off < n; off += chunk) {
    const int64_t len = std::min(chunk, n - off);
    const torch::Tensor w = words.narrow(0, off, len).to(torch::kLong);
    const torch::Tensor pos = torch::arange(off, off + len, opts);
    s1 += (w * (pos * int64_t{2654435761} % int64_t{2147483647} + 1)).sum();
    s2 += (w * (pos * int64_t{40503} % int64_t{1000003} + 7)).sum();
  }
  return mix(mix(h, static_cast<uint64_t>(s1.item<int64_t>())), static_cast<uint64_t>(s2.item<int64_t>()));
}

int64_t storage_bytes(const std::vector<torch::Tensor>& tensors) {
  std::set<const void*> seen;
  int64_t total = 0;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    if (seen.insert(s).second) total += static_cast<int64_t>(s->nbytes());
  }
  return total;
}

void ParallelStrategy::zero_grad(torch::optim::Optimizer& opt) { opt.zero_grad(); }

ModelStateBytes ParallelStrategy::model_state(const torch::optim::Optimizer& opt, int64_t words) const {
  ModelStateBytes m;
  std::vector<torch::Tensor> params = model_->parameters(), grads, states;
  for (const auto& p : params) grads.push_back(p.grad());
  for (const auto& group : opt.param_groups())
    for (const auto& p : group.params()) grads.push_back(p.grad());
  for (const auto& [key, state] : opt.state()) {
    if (auto* a = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      states.push_back(a->exp_avg());
      states.push_back(a->exp_avg_sq());
      states.push_back(a->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      states.push_back(s->momentum_buffer());
    }
  }
  m.params = storage_bytes(params);
  m.grads = storage_bytes(grads);
  m.optimizer = storage_bytes(states);
  return m;
}

uint64_t ParallelStrategy::parameter_fingerprint() {
  uint64_t h = 1469598103934665603ULL;
  for (const auto& p : model_->parameters()) h = fingerprint(p, h);
  return h;
}

torch::Tensor ParallelStrategy::full_parameters() {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> parts;
  for (const auto& p : model_->parameters()) parts.push_back(p.detach().reshape(-1).to(torch::kFloat));
  return torch::cat(parts);
}

double ParallelStrategy::parameter_spread() {
  if (!comm_) return 0.0;
  torch::NoGradGuard no_grad;
  torch::Tensor hi = full_parameters().cpu();
  torch::Tensor neg_lo = -hi;
  comm_->all_reduce_max(hi);
  comm_->all_reduce_max(neg_lo);  // -min over ranks
  return (hi + neg_lo).max().item<double>();
}

void ParallelStrategy::clip_grad_norm(const std::vector<torch::Tensor>& opt_params, double max_norm, const std::vector<bool>& counted,
                                      const std::vector<Communicator*>& across) {
  if (!comm_ && across.empty()) {
    torch::nn::utils::clip_grad_norm_(opt_params, max_norm);
    return;
  }
  torch::NoGradGuard no_grad;
  // fp32 at least (as torch's clip_grad_norm_ on fp32 gradients), fp64 for fp64 gradients or a sum across
  // a second group.
  const bool wide = !across.empty() || std::any_of(opt_params.begin(), opt_params.end(), [](const torch::Tensor& p) {
                      return p.grad().defined() && p.grad().scalar_type() == torch::kDouble;
                    });
  const auto dtype = wide ? torch::kDouble : torch::kFloat;
  torch::Tensor sq = torch::zeros({1}, dtype);
  const std::vector<Ranges> ranges = counted.empty() ? std::vector<Ranges>{} : counted_ranges(counted);
  for (size_t i = 0; i < opt_params.size(); ++i) {
    const torch::Tensor& g = opt_params[i].grad();
    if (!g.defined()) continue;
    if (counted.empty()) {
      sq += g.to(dtype).pow(2).sum().cpu();
      continue;
    }
    const torch::Tensor flat = g.reshape(-1);
    for (const auto& [begin, end] : ranges.at(i)) sq += flat.narrow(0, begin, end - begin).to(dtype).pow(2).sum().cpu();
  }
  if (sliced_gradients()) gradient_group()->all_reduce(sq, /*average=*/false);
  for (Communicator* group : across) group->all_reduce(sq, /*average=*/false);
  const double norm = std::sqrt(sq.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1)
    for (const auto& p : opt_params)
      if (p.grad().defined()) p.grad().mul_(coef);
}

std::vector<ParallelStrategy::Ranges> ParallelStrategy::counted_ranges(const std::vector<bool>& counted) const {
  std::vector<Ranges> out;
  const auto params = model_->parameters();  // the optimizer's tensors when nothing is sharded or flattened
  for (size_t i = 0; i < params.size(); ++i)
    out.push_back(counted.at(i) ? Ranges{{0, params[i].numel()}} : Ranges{});
  return out;
}

std::set<const void*> ParallelStrategy::counted_parameters(const std::vector<bool>& counted) const {
  std::set<const void*> out;
  const auto params = model_->parameters();
  for (size_t i = 0; i < params.size(); ++i)
    if (counted.at(i)) out.insert(params[i].unsafeGetTensorImpl());
  return out;
}

std::vector<torch::Tensor> ParallelStrategy::master_values() {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> out;
  for (const auto& p : model_->parameters()) out.push_back(p.detach().clone());
  return out;
}

std::unique_ptr<ParallelStrategy> make_strategy(const Mesh& mesh, double bucket_mb, bool prefetch, const ParamPolicy& policy) {
  if (const std::string why = layout_unsupported(mesh.layout()); !why.empty()) throw UsageError(why);
  const std::string s = mesh.strategy_layout().strategy();  // cp's ranks folded into the data-parallel ones
  const bool one = s == "single" || !mesh.world();
  Communicator* replicate = one ? nullptr : mesh.strategy_group("dp_replicate");
  if (policy.master && (one || s == "ddp"))  // one process, or FSDP2's replicate: units without a shard group
    return detail::make_fully_shard(one ? nullptr : mesh.data_parallel(), nullptr, replicate, prefetch, policy);
  if (one) return std::make_unique<Single>();
  if (s == "ddp") return detail::make_ddp(replicate, bucket_mb);
  Communicator* shard = mesh.strategy_group("dp_shard");
  if (s == "zero1" || s == "zero2") return detail::make_zero12(shard, s == "zero1" ? 1 : 2, bucket_mb, policy);
  return detail::make_fully_shard(mesh.data_parallel(), shard, replicate, prefetch, policy);
}

}  // namespace trainscope::suites
