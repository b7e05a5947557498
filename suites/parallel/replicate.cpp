// The data-parallel strategies whose gradients travel in buckets during backward: ddp (c10d's
// Reducer, all-reduced), zero1 (all-reduced, then each rank steps its slice) and zero2 (each bucket
// reduced to the ranks owning its slices). zero3 and hsdp: fully_shard.cpp.
#include <atomic>
#include <mutex>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "core/compat.hpp"
#include "suites/parallel/sharding.hpp"

namespace trainscope::suites::detail {
namespace {

// The reducer's communication hook: average then all-reduce each bucket, timing launch to
// completion. It runs on the autograd thread (launch) and a Gloo/NCCL thread (completion), so the
// records go through a mutex and reach the probe from the training thread.
struct TimedAllReduce : c10d::CommHookInterface {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int world = 1;
  std::shared_ptr<std::mutex> mu = std::make_shared<std::mutex>();
  std::shared_ptr<std::vector<BucketRecord>> records = std::make_shared<std::vector<BucketRecord>>();

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    torch::Tensor buf = bucket.getBufferRef();
    buf.div_(world);
    const size_t index = [&] {
      std::lock_guard<std::mutex> lock(*mu);
      records->push_back({bytes_of(buf), now_s(), 0, {}});
      return records->size() - 1;
    }();
    std::vector<torch::Tensor> v{buf};
    auto work = pg->allreduce(v);
    auto fut = work->getFuture();
    {
      std::lock_guard<std::mutex> lock(*mu);
      (*records)[index].works.push_back(work);
    }
    auto mu_ = mu;
    auto rec = records;
    return fut->then(
        [mu_, rec, index, buf](c10::ivalue::Future&) {
          std::lock_guard<std::mutex> lock(*mu_);
          (*rec)[index].end = now_s();
          return c10::IValue(buf);
        },
        c10::TensorType::get());
  }
  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isTensorList()) return result.toTensorVector().at(0);
    return result.toTensor();
  }
};

// c10d's Reducer over a list of parameters: gradients are averaged and all-reduced bucket by bucket as
// backward produces them (PyTorch's DDP: a small first bucket, 1 MiB or bucket_mb if smaller, so that
// communication starts early, then bucket_mb; buckets in reverse parameter order, the order gradients
// arrive). With `as_view` the gradients become views of the buckets (DDP's gradient_as_bucket_view);
// without, the reducer copies the reduced buckets back into the gradients the parameters already have
// (zero1's views of its flat buffer keep their layout).
class BucketedAllReduce {
 public:
  BucketedAllReduce(Communicator& comm, const std::vector<torch::Tensor>& params, int64_t bucket_bytes, bool as_view)
      : comm_(comm) {
    const size_t first = std::min<size_t>(1024 * 1024, static_cast<size_t>(std::max<int64_t>(bucket_bytes, 1)));
    auto indices = std::get<0>(c10d::compute_bucket_assignment_by_size(
        params, {first, static_cast<size_t>(std::max<int64_t>(bucket_bytes, 1))}, std::vector<bool>(params.size(), false)));
    std::reverse(indices.begin(), indices.end());
    reducer_ = compat::make_reducer<c10d::Reducer>(params, indices, comm.process_group(),
                                                   std::vector<bool>(params.size(), false), bucket_bytes,
                                                   /*find_unused=*/false, as_view, {}, first);
    auto hook = std::make_unique<TimedAllReduce>();
    hook->pg = comm.process_group();
    hook->world = comm.world_size();
    mu_ = hook->mu;
    records_ = hook->records;
    reducer_->register_comm_hook(std::move(hook));
  }
  void before_forward() {
    reducer_->rebuild_buckets();  // after the first iteration, in the order gradients arrived
    reducer_->prepare_for_forward();
  }
  void before_backward() { reducer_->prepare_for_backward({}); }
  // backward() returned: the reducer has waited for every bucket.
  void report() {
    std::vector<BucketRecord> recs;
    {
      std::lock_guard<std::mutex> lock(*mu_);
      recs.swap(*records_);
    }
    report_buckets(comm_, "all-reduce", recs, now_s());
  }

 private:
  Communicator& comm_;
  std::unique_ptr<c10d::Reducer> reducer_;
  std::shared_ptr<std::mutex> mu_;
  std::shared_ptr<std::vector<BucketRecord>> records_;
};

// ZeRO-2's gradient reduction during backward (DeepSpeed's overlap_comm; FSDP2 without resharding
// after forward). Parameters are bucketed in the order their gradients arrive (reverse parameter
// order, a small first bucket as DDP's so that communication starts early). Once every gradient of a
// bucket has been accumulated into the flat gradient buffer, the bucket is reduced to the ranks whose
// slices of the flat buffer it covers, one `reduce` per owner as DeepSpeed does: a bucket's range does
// not split evenly among the ranks, so it cannot be one reduce-scatter, but together the reduces move
// a reduce-scatter's bytes and each rank receives its slice. Buckets launch in the same order on every
// rank (the collectives must match); an engine callback at the end of backward (as DDP's reducer)
// launches any bucket a gradient never reached and waits for what is still in flight.
class BucketedReduceScatter {
 public:
  BucketedReduceScatter(Communicator& comm, FlatParams& flat, int64_t bucket_bytes)
      : comm_(comm), flat_(flat), state_(std::make_shared<State>()) {
    const int64_t elem = flat.flat.element_size();
    const int64_t cap = std::max<int64_t>(bucket_bytes, 1), first = std::min<int64_t>(1024 * 1024, cap);
    std::vector<int64_t> offset(flat.params.size());
    for (size_t i = 0, off = 0; i < flat.params.size(); off += flat.params[i].numel(), ++i)
      offset[i] = static_cast<int64_t>(off);
    state_->bucket_of.assign(flat.params.size(), 0);
    for (size_t k = flat.params.size(); k-- > 0;) {
      const int64_t lo = offset[k], hi = lo + flat.params[k].numel();
      Bucket* b = state_->buckets.empty() ? nullptr : &state_->buckets.back();
      const int64_t limit = state_->buckets.size() <= 1 ? first : cap;
      if (!b || (b->end - b->begin) * elem >= limit) {
        state_->buckets.push_back({lo, hi, 0});
        b = &state_->buckets.back();
      }
      b->begin = lo;  // parameters come in reverse order: the bucket grows downwards
      ++b->params;
      state_->bucket_of[k] = static_cast<int>(state_->buckets.size() - 1);
    }
    state_->ends = std::make_unique<std::atomic<double>[]>(state_->buckets.size());
    for (size_t k = 0; k < flat.params.size(); ++k)
      torch::autograd::impl::set_post_acc_grad_hooks(flat.params[k], std::make_unique<Ready>(state_, this, k));
  }
  ~BucketedReduceScatter() {
    for (const auto& p : flat_.params) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
  }
  // Arms the hooks for the coming backward.
  void before_backward() {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->remaining.clear();
    for (size_t i = 0; i < state_->buckets.size(); ++i) {
      state_->remaining.push_back(state_->buckets[i].params);
      state_->ends[i] = 0.0;
    }
    state_->next = 0;
    state_->armed = true;
    state_->callback_queued = false;
  }
  // After backward: this rank's slice of flat.grad holds the sum over ranks.
  void report() {
    finish();  // a backward that reached no parameter queued no callback
    std::vector<BucketRecord> recs;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      recs.swap(state_->records);
    }
    for (size_t i = 0; i < recs.size(); ++i) recs[i].end = state_->ends[i].load();  // launched in bucket order
    report_buckets(comm_, "reduce-scatter", recs, now_s());
  }

 private:
  struct Bucket {
    int64_t begin, end;  // a range of the flat buffer
    int params;
  };
  struct State {
    std::mutex mu;
    std::vector<Bucket> buckets;
    std::vector<int> bucket_of, remaining;
    size_t next = 0;  // the next bucket to launch
    bool armed = false, callback_queued = false;
    std::vector<BucketRecord> records;  // per launched bucket, in launch order
    // Completion times, per bucket; written by Gloo/NCCL threads without the mutex (a future that is
    // already complete runs its callback inline, where the launching thread holds the mutex).
    std::unique_ptr<std::atomic<double>[]> ends;
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
  };
  // The hook autograd runs once a parameter's gradient has been accumulated. It holds the state, not
  // only the reducer, so that a backward outside training (evaluation) finds it disarmed, not freed.
  struct Ready : torch::autograd::PostAccumulateGradHook {
    Ready(std::shared_ptr<State> s, BucketedReduceScatter* owner, size_t index)
        : state(std::move(s)), owner(owner), index(index) {}
    void operator()(const torch::autograd::Variable&) override {
      std::lock_guard<std::mutex> lock(state->mu);
      if (!state->armed) return;
      if (!state->callback_queued) {
        state->callback_queued = true;
        torch::autograd::Engine::get_default_engine().queue_callback([o = owner] { o->finish(); });
      }
      --state->remaining[state->bucket_of[index]];
      owner->launch_ready(/*all=*/false);
    }
    std::shared_ptr<State> state;
    BucketedReduceScatter* owner;
    size_t index;
  };

  // Under state_->mu: launches, in order, the buckets whose gradients are all there (all: every one).
  void launch_ready(bool all) {
    State& st = *state_;
    const int64_t shard = flat_.shard, elem = flat_.grad.element_size();
    while (st.next < st.buckets.size() && (all || st.remaining[st.next] == 0)) {
      const size_t index = st.next++;
      const Bucket& b = st.buckets[index];
      st.records.push_back({(b.end - b.begin) * elem, now_s(), 0, {}});
      for (int r = 0; r < comm_.world_size(); ++r) {
        const int64_t lo = std::max(b.begin, r * shard), hi = std::min(b.end, (r + 1) * shard);
        if (lo >= hi) continue;
        std::vector<torch::Tensor> part{flat_.grad.narrow(0, lo, hi - lo)};
        c10d::ReduceOptions o;
        o.rootRank = r;
        auto work = comm_.process_group()->reduce(part, o);
        st.records.back().works.push_back(work);
        std::weak_ptr<State> weak = state_;
        work->getFuture()->addCallback([weak, index](c10::ivalue::Future&) {
          if (auto s = weak.lock()) {
            std::atomic<double>& end = s->ends[index];
            const double t = now_s();
            for (double seen = end.load(); seen < t && !end.compare_exchange_weak(seen, t);) {
            }
          }
        });
        st.works.push_back(std::move(work));
      }
    }
  }
  // End of backward: launch what is left, wait for everything in flight.
  void finish() {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      if (!state_->armed) return;
      state_->armed = false;
      launch_ready(/*all=*/true);
      works.swap(state_->works);
    }
    for (auto& w : works) w->wait();  // unlocked: the completion callbacks take the mutex
  }

  Communicator& comm_;
  FlatParams& flat_;
  std::shared_ptr<State> state_;
};

class Ddp : public ParallelStrategy {
 public:
  Ddp(Communicator* comm, double bucket_mb) : ParallelStrategy(comm), bucket_bytes_(static_cast<int64_t>(bucket_mb * 1024 * 1024)) {}
  std::string sharding_level() const override { return "ddp"; }

  std::vector<torch::Tensor> setup(ReferenceModel& model, bool broadcast) override {
    model_ = &model;
    params_ = model.parameters();
    if (broadcast) {
      torch::NoGradGuard no_grad;
      comm_->broadcast(params_, 0);
    }
    broadcast_buffers(*comm_, model);
    reducer_ = std::make_unique<BucketedAllReduce>(*comm_, params_, bucket_bytes_, /*as_view=*/true);
    return params_;
  }

  void zero_grad(torch::optim::Optimizer&) override {
    // The gradients are views of the reducer's buckets: zero them in place, never replace them.
    torch::NoGradGuard no_grad;
    for (auto& p : params_)
      if (p.grad().defined()) p.mutable_grad().zero_();
  }
  void before_forward() override { reducer_->before_forward(); }
  void before_backward() override { reducer_->before_backward(); }
  void reduce_gradients() override { reducer_->report(); }

 private:
  int64_t bucket_bytes_;
  std::vector<torch::Tensor> params_;
  std::unique_ptr<BucketedAllReduce> reducer_;
};

// ---- zero1 / zero2 ----------------------------------------------------------------------------
class Zero12 : public ParallelStrategy {
 public:
  Zero12(Communicator* comm, int stage, double bucket_mb)
      : ParallelStrategy(comm), stage_(stage), bucket_bytes_(static_cast<int64_t>(bucket_mb * 1024 * 1024)) {}
  bool sliced_gradients() const override { return true; }
  std::string sharding_level() const override { return stage_ == 1 ? "zero1" : "zero2"; }

  std::vector<torch::Tensor> setup(ReferenceModel& model, bool broadcast) override {
    model_ = &model;
    flat_.build(model.parameters(), comm_->world_size());
    if (broadcast) {
      torch::NoGradGuard no_grad;
      comm_->broadcast({flat_.flat}, 0);
    }
    broadcast_buffers(*comm_, model);
    const int r = comm_->rank();
    shard_ = optimizer_slice(flat_.slice(flat_.flat, r), /*share=*/true);
    if (stage_ == 1) {
      shard_.mutable_grad() = flat_.slice(flat_.grad, r).detach();
      // ZeRO-1 all-reduces the gradients as DDP does, during backward, bucket by bucket; the reduced
      // buckets are copied back into the flat gradient, whose slice is this rank's shard's gradient.
      reducer_ = std::make_unique<BucketedAllReduce>(*comm_, flat_.params, bucket_bytes_, /*as_view=*/false);
    } else {
      shard_.mutable_grad() = torch::zeros({flat_.shard}, flat_.flat.options());
      release_storage(flat_.grad);
      scatter_ = std::make_unique<BucketedReduceScatter>(*comm_, flat_, bucket_bytes_);
    }
    return {shard_};
  }
  std::vector<Ranges> counted_ranges(const std::vector<bool>& counted) const override {
    return {flat_.ranges_in_slice(comm_->rank(), counted_parameters(counted))};
  }
  void zero_grad(torch::optim::Optimizer&) override { zero_flat_gradients(flat_, shard_); }
  void before_forward() override {
    if (reducer_) reducer_->before_forward();
  }
  void before_backward() override {
    if (reducer_) reducer_->before_backward();
    if (scatter_) scatter_->before_backward();
  }
  void reduce_gradients() override {
    torch::NoGradGuard no_grad;
    if (stage_ == 1) {
      reducer_->report();  // reduced during backward
    } else {
      scatter_->report();  // reduced to their owners during backward
      shard_.mutable_grad().copy_(flat_.slice(flat_.grad, comm_->rank())).div_(comm_->world_size());
      release_storage(flat_.grad);  // only this rank's slice of the gradients stays
    }
  }
  void after_step() override {
    torch::NoGradGuard no_grad;
    comm_->all_gather(flat_.flat, flat_.slice(flat_.flat, comm_->rank()));
  }

 private:
  int stage_;
  int64_t bucket_bytes_;
  FlatParams flat_;
  torch::Tensor shard_;
  std::unique_ptr<BucketedAllReduce> reducer_;  // zero1
  std::unique_ptr<BucketedReduceScatter> scatter_;  // zero2
};

// ---- zero1 / zero2 with fp32 masters (bf16-master) -----------------------------------------------
// Forward and backward run on a bf16 copy of the whole model (2Ψ), whose bf16 gradients are converted
// into a reduce_dtype buffer after backward and reduce-scattered (the mean over ranks) into the fp32
// gradient of this rank's slice of the masters; the optimizer steps the slice, and its bf16 cast is
// all-gathered back into the copy. zero1 keeps the full gradient buffer between steps (Megatron's
// distributed optimizer: (2+4)Ψ + 12Ψ/N), zero2 frees it (2Ψ + 16Ψ/N). One reduce-scatter after
// backward: the numerics of FSDP2's MixedPrecisionPolicy, not DeepSpeed's overlapped buckets.
class MasterZero12 : public ParallelStrategy {
 public:
  MasterZero12(Communicator* comm, int stage, const ParamPolicy& policy) : ParallelStrategy(comm), stage_(stage), policy_(policy) {}
  bool sliced_gradients() const override { return true; }
  std::string sharding_level() const override { return stage_ == 1 ? "zero1" : "zero2"; }

  std::vector<torch::Tensor> setup(ReferenceModel& model, bool broadcast) override {
    model_ = &model;
    const int world = comm_->world_size(), r = comm_->rank();
    torch::NoGradGuard no_grad;
    torch::Tensor values = flat_values(model.parameters(), world, at::kFloat);  // the masters, before the bf16 copy rounds them
    if (broadcast) comm_->broadcast({values}, 0);
    flat_.build(model.parameters(), world, policy_.compute, policy_.compute);
    flat_.flat.copy_(values);
    shard_ = values.narrow(0, r * flat_.shard, flat_.shard).clone().requires_grad_(true);
    if (stage_ == 1) accumulator_ = torch::zeros({flat_.flat.numel()}, values.options().dtype(policy_.reduce));
    // zero1 in fp32: the slice's gradient is its part of the full buffer (Megatron's main_grad views).
    shard_.mutable_grad() = stage_ == 1 && policy_.reduce == shard_.scalar_type() ? accumulator_.narrow(0, r * flat_.shard, flat_.shard)
                                                                                : torch::zeros_like(shard_);
    release_storage(flat_.grad);  // allocated by zero_grad
    broadcast_buffers(*comm_, model);
    return {shard_};
  }
  std::vector<Ranges> counted_ranges(const std::vector<bool>& counted) const override {
    return {flat_.ranges_in_slice(comm_->rank(), counted_parameters(counted))};
  }
  void zero_grad(torch::optim::Optimizer&) override { zero_flat_gradients(flat_, shard_); }
  void reduce_gradients() override {
    torch::NoGradGuard no_grad;
    // zero2 reduces the bf16 gradients in place when they are already in reduce_dtype (a conversion
    // would return the same tensor), else a converted copy; zero1 through its reduce_dtype buffer.
    const bool in_place = stage_ == 2 && flat_.grad.scalar_type() == policy_.reduce;
    torch::Tensor full = stage_ == 1 ? accumulator_.copy_(flat_.grad) : in_place ? flat_.grad : flat_.grad.to(policy_.reduce);
    if (!in_place) release_storage(flat_.grad);
    torch::Tensor out = torch::empty({flat_.shard}, full.options());
    comm_->reduce_scatter(out, full, /*average=*/true);  // `full` is the collective's scratch: then the slice
    shard_.mutable_grad().copy_(out);
    if (in_place) release_storage(flat_.grad);
  }
  void after_step() override {
    torch::NoGradGuard no_grad;
    comm_->all_gather(flat_.flat, shard_.detach().to(policy_.compute));
  }
  std::vector<torch::Tensor> master_values() override {
    torch::NoGradGuard no_grad;
    torch::Tensor full = torch::empty({flat_.flat.numel()}, shard_.options());
    comm_->all_gather(full, shard_.detach());
    std::vector<torch::Tensor> out;
    int64_t off = 0;
    for (const auto& p : flat_.params) {
      out.push_back(full.narrow(0, off, p.numel()).view(p.sizes()).clone());
      off += p.numel();
    }
    return out;
  }
  ModelStateBytes model_state(const torch::optim::Optimizer& opt, int64_t words) const override {
    ModelStateBytes m = ParallelStrategy::model_state(opt, words);
    m.params = storage_bytes({flat_.flat, shard_});
    m.grads = storage_bytes({flat_.grad, shard_.grad(), accumulator_});
    return m;
  }

 private:
  int stage_;
  ParamPolicy policy_;
  FlatParams flat_;
  torch::Tensor shard_, accumulator_;  // the fp32 master slice; zero1's full gradient buffer
};

}  // namespace

std::unique_ptr<ParallelStrategy> make_ddp(Communicator* comm, double bucket_mb) { return std::make_unique<Ddp>(comm, bucket_mb); }
std::unique_ptr<ParallelStrategy> make_zero12(Communicator* comm, int stage, double bucket_mb, const ParamPolicy& policy) {
  if (policy.master) return std::make_unique<MasterZero12>(comm, stage, policy);
  return std::make_unique<Zero12>(comm, stage, bucket_mb);
}

}  // namespace trainscope::suites::detail
