#include "suites/parallel/strategies.hpp"

#include <atomic>
#include <chrono>
#include <cmath>
#include <mutex>
#include <set>

#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include "core/compat.hpp"
#include "core/errors.hpp"

namespace trainscope::suites {
namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Frees a buffer's memory while every view of it stays valid (FSDP's storage resize): autograd's
// saved references to a gathered parameter survive, and allocate_storage() refills the same storage.
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

// A list of parameters turned into views of one flat buffer, padded to a multiple of the world size
// so that every rank owns an equal slice.
struct FlatParams {
  std::vector<torch::Tensor> params;
  torch::Tensor flat, grad;
  int64_t numel = 0, shard = 0;

  void build(const std::vector<torch::Tensor>& ps, int world) {
    params = ps;
    for (const auto& p : ps) numel += p.numel();
    shard = (numel + world - 1) / world;
    torch::NoGradGuard no_grad;
    const auto opts = ps.front().options();
    flat = torch::zeros({shard * world}, opts);
    grad = torch::zeros({shard * world}, opts);
    int64_t off = 0;
    for (auto& p : params) {
      const int64_t n = p.numel();
      flat.narrow(0, off, n).copy_(p.reshape(-1));
      p.set_data(flat.narrow(0, off, n).view(p.sizes()));
      p.mutable_grad() = grad.narrow(0, off, n).view(p.sizes());
      off += n;
    }
  }
  torch::Tensor slice(const torch::Tensor& buf, int rank) const { return buf.narrow(0, rank * shard, shard); }
};

// A leaf tensor the optimizer owns: this rank's slice of a flat buffer, sharing its memory (zero1/2:
// the step updates the flat parameters in place) or a copy (zero3: the flat buffer is freed at rest).
torch::Tensor optimizer_slice(const torch::Tensor& data, bool share) {
  torch::Tensor t = share ? data.detach() : data.detach().clone();
  return t.requires_grad_(true);
}

// ---- single -----------------------------------------------------------------------------------
class Single : public ParallelStrategy {
 public:
  Single() : ParallelStrategy(nullptr) {}
  std::vector<torch::Tensor> setup(ReferenceModel& model, bool) override {
    model_ = &model;
    return model.parameters();
  }
};

void broadcast_buffers(Communicator& comm, ReferenceModel& model) {
  std::vector<torch::Tensor> bufs;
  for (const auto& b : model.buffers())
    if (b.is_floating_point()) bufs.push_back(b);
  if (!bufs.empty()) {
    torch::NoGradGuard no_grad;
    comm.broadcast(bufs, 0);
  }
}

// ---- ddp --------------------------------------------------------------------------------------
// The reducer's communication hook: average then all-reduce each bucket, timing launch to
// completion. It runs on the autograd thread (launch) and a Gloo/NCCL thread (completion), so the
// records go through a mutex and reach the probe from the training thread.
struct BucketRecord {
  int64_t bytes = 0;
  double start = 0, end = 0;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;  // for the device clock (NCCL's CUDA events)
};

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
                     i + 1 == recs.size() ? exposed : 0.0, comm.step(), recs[i].end, ""};
    comm.report_after(c, std::move(recs[i].works));
  }
}

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
  void zero_grad(torch::optim::Optimizer&) override {
    torch::NoGradGuard no_grad;
    allocate_storage(flat_.grad);
    flat_.grad.zero_();
    shard_.mutable_grad().zero_();
  }
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

// ---- zero3 ------------------------------------------------------------------------------------
// One unit of full sharding: a block's parameters (or the root's), flat and sharded.
struct Unit : torch::CustomClassHolder {
  FlatParams fp;
  torch::Tensor shard;  // this rank's slice: a leaf the optimizer owns (its own memory)
  Communicator* comm = nullptr;       // the group the unit is sharded over (zero3: the world)
  Communicator* replicas = nullptr;   // hsdp: the same slice on the other shard groups (else null)

  std::shared_ptr<PendingCollective> pending;  // a prefetch in flight

  // Full parameters resident: the prefetch's, when one was launched, else gathered now.
  void gather() {
    if (pending) {
      pending->wait();
      pending.reset();
      return;
    }
    allocate_storage(fp.flat);
    torch::NoGradGuard no_grad;
    comm->all_gather(fp.flat, shard.detach());
  }
  // Starts gathering while the caller goes on computing (FSDP's forward and backward prefetch).
  void prefetch() {
    if (pending || fp.flat.storage().nbytes() > 0) return;
    allocate_storage(fp.flat);
    torch::NoGradGuard no_grad;
    pending = comm->all_gather_async(fp.flat, shard.detach());
  }
  void release() { release_storage(fp.flat); }
  // The block's parameter gradients -> this rank's slice of their mean over ranks.
  torch::Tensor reduce(const std::vector<torch::Tensor>& grads) {
    torch::NoGradGuard no_grad;
    allocate_storage(fp.grad);
    int64_t off = 0;
    for (size_t i = 0; i < fp.params.size(); ++i) {
      const int64_t n = fp.params[i].numel();
      if (grads[i].defined())
        fp.grad.narrow(0, off, n).copy_(grads[i].reshape(-1));
      else
        fp.grad.narrow(0, off, n).zero_();
      off += n;
    }
    fp.grad.narrow(0, off, fp.grad.numel() - off).zero_();
    torch::Tensor out = torch::empty({fp.shard}, fp.flat.options());
    reduce_scatter_grad(out);
    release_storage(fp.grad);
    return out;
  }
  // out <- this rank's slice of fp.grad averaged over every rank: over the shard group, then (hsdp)
  // over the replicas, so that the mean is over the world as for zero3.
  void reduce_scatter_grad(torch::Tensor& out) {
    comm->reduce_scatter(out, fp.grad, /*average=*/true);
    if (replicas) replicas->all_reduce(out, /*average=*/true);
  }
};

struct Zero3Call : torch::CustomClassHolder {
  c10::intrusive_ptr<Unit> unit;
  c10::intrusive_ptr<Unit> next_forward, next_backward;  // prefetched while this block computes (or null)
  BlockFn body;
  torch::Tensor input, output;  // the block's own graph, kept from forward to backward
};

// Runs a block between a gather and a release. The block's graph is recorded inside forward (grad
// mode on), so its activations are kept exactly as without sharding (or recomputed, when the body is
// checkpointed); backward re-gathers the parameters that graph refers to, takes the gradients and
// reduce-scatters them into the shard's gradient.
struct Zero3BlockFunction : public torch::autograd::Function<Zero3BlockFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& shard, c10::intrusive_ptr<Zero3Call> call) {
    call->unit->gather();
    if (call->next_forward) call->next_forward->prefetch();
    call->input = x.detach().requires_grad_(x.requires_grad());
    {
      torch::AutoGradMode grad_on(true);
      call->output = call->body(call->input);
    }
    call->unit->release();
    ctx->saved_data["call"] = c10::IValue::make_capsule(call);
    return call->output.detach();
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    auto call = c10::static_intrusive_pointer_cast<Zero3Call>(ctx->saved_data["call"].toCapsule());
    Unit& unit = *call->unit;
    unit.gather();
    if (call->next_backward) call->next_backward->prefetch();
    std::vector<torch::Tensor> wrt = unit.fp.params;
    const bool input_grad = call->input.requires_grad();
    if (input_grad) wrt.push_back(call->input);
    auto grads = torch::autograd::grad({call->output}, wrt, {grad_out[0]}, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    call->output = torch::Tensor();
    unit.release();
    torch::Tensor input_g = input_grad ? grads.back() : torch::Tensor();
    grads.resize(unit.fp.params.size());
    torch::Tensor shard_g = unit.reduce(grads);
    return {input_g, shard_g, torch::Tensor()};
  }
};

// zero3 shards every unit over the world. hsdp (hybrid sharding: FSDP's HYBRID_SHARD, FSDP2 on a 2-D
// mesh, DeepSpeed ZeRO++'s hpZ) shards it over a group of shard_size ranks (0: the ranks of one
// node) and keeps one copy per group: a unit's gradients are reduce-scattered within the group, then
// each slice all-reduced with the same slice of the other groups. The gathers stay on the fast
// links inside a node; across nodes only the gradient slices travel, Ψ/shard_size per rank per step.
class Zero3 : public ParallelStrategy {
 public:
  Zero3(Communicator* comm, bool prefetch, bool hybrid = false, int64_t shard_size = 0)
      : ParallelStrategy(comm), prefetch_(prefetch), hybrid_(hybrid), shard_size_(shard_size) {}
  bool sliced_gradients() const override { return true; }
  Communicator* gradient_group() const override { return shard_comm_; }
  int64_t sharding_degree() const override { return shard_comm_ ? shard_comm_->world_size() : 1; }

  std::vector<torch::Tensor> setup(ReferenceModel& model, bool broadcast) override {
    model_ = &model;
    shard_comm_ = comm_;
    if (hybrid_) form_groups();
    const int world = shard_comm_->world_size(), rank = shard_comm_->rank();
    std::set<const void*> in_blocks;
    for (torch::nn::Module* b : model.blocks()) {
      auto u = c10::make_intrusive<Unit>();
      u->fp.build(b->parameters(), world);
      for (const auto& p : u->fp.params) in_blocks.insert(p.unsafeGetTensorImpl());
      units_.push_back(u);
    }
    std::vector<torch::Tensor> rest;
    for (const auto& p : model.parameters())
      if (!in_blocks.count(p.unsafeGetTensorImpl())) rest.push_back(p);
    root_ = c10::make_intrusive<Unit>();
    root_->fp.build(rest, world);
    std::vector<torch::Tensor> owned;
    for (auto* u : all_units()) {
      u->comm = shard_comm_;
      u->replicas = replica_comm_.get();
      if (broadcast) {
        torch::NoGradGuard no_grad;
        comm_->broadcast({u->fp.flat}, 0);
      }
      u->shard = optimizer_slice(u->fp.slice(u->fp.flat, rank), /*share=*/false);
      u->shard.mutable_grad() = torch::zeros_like(u->shard);
      u->release();
      release_storage(u->fp.grad);
      owned.push_back(u->shard);
    }
    // The root's parameters take their gradients through the normal path into fp.grad's views.
    broadcast_buffers(*comm_, model);
    model.set_block_wrapper([this](int64_t index, const BlockFn& body, const torch::Tensor& x) {
      auto call = c10::make_intrusive<Zero3Call>();
      const size_t i = static_cast<size_t>(index);
      call->unit = units_.at(i);
      if (prefetch_) {
        if (i + 1 < units_.size()) call->next_forward = units_[i + 1];
        if (i > 0) call->next_backward = units_[i - 1];
      }
      call->body = body;
      return Zero3BlockFunction::apply(x, call->unit->shard, call);
    });
    return owned;
  }
  void zero_grad(torch::optim::Optimizer&) override {
    torch::NoGradGuard no_grad;
    for (auto* u : all_units()) u->shard.mutable_grad().zero_();
  }
  void before_forward() override {
    root_->gather();
    allocate_storage(root_->fp.grad);
    torch::NoGradGuard no_grad;
    root_->fp.grad.zero_();
  }
  void reduce_gradients() override {
    // Block gradients were reduce-scattered during backward; the root's now.
    torch::NoGradGuard no_grad;
    torch::Tensor g = root_->shard.mutable_grad();
    root_->reduce_scatter_grad(g);
    release_storage(root_->fp.grad);
    root_->release();
  }
  void materialize() override {
    for (auto* u : all_units()) u->gather();
  }
  uint64_t parameter_fingerprint() override {
    uint64_t h = 1469598103934665603ULL;
    for (auto* u : all_units()) {
      const bool resident = u->fp.flat.storage().nbytes() > 0;
      if (!resident) u->gather();
      h = fingerprint(u->fp.flat.narrow(0, 0, u->fp.numel), h);
      if (!resident) u->release();
    }
    return h;
  }
  torch::Tensor full_parameters() override {
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> parts;
    for (auto* u : all_units()) {
      const bool resident = u->fp.flat.storage().nbytes() > 0;
      if (!resident) u->gather();
      parts.push_back(u->fp.flat.narrow(0, 0, u->fp.numel).to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true));
      if (!resident) u->release();
    }
    return torch::cat(parts);
  }
  ModelStateBytes model_state(const torch::optim::Optimizer& opt, int64_t words) const override {
    ModelStateBytes m = ParallelStrategy::model_state(opt, words);
    // The gathered buffers are released at rest; what the rank holds is its shards and their gradients.
    std::vector<torch::Tensor> shards, grads;
    for (auto* u : all_units()) {
      shards.push_back(u->shard);
      shards.push_back(u->fp.flat);
      grads.push_back(u->shard.grad());
      grads.push_back(u->fp.grad);
    }
    m.params = storage_bytes(shards);
    m.grads = storage_bytes(grads);
    return m;
  }

 private:
  std::vector<Unit*> all_units() const {
    std::vector<Unit*> out;
    for (auto& u : units_) out.push_back(u.get());
    out.push_back(root_.get());
    return out;
  }
  // hsdp's two groups for this rank: its shard group (a node's ranks, or shard_size consecutive
  // ranks) and its replica group (the ranks at the same place in the other shard groups). Each is
  // named by the links it crosses: intra-node when all its ranks share a host.
  void form_groups() {
    const int world = comm_->world_size(), me = comm_->rank();
    const std::vector<std::vector<int>> hosts = comm_->ranks_by_host();
    std::vector<std::vector<int>> shards;
    if (shard_size_ == 0) {
      for (const auto& h : hosts)
        if (h.size() != hosts.front().size())
          throw UsageError("hsdp shards over one node's ranks, but the nodes hold " + std::to_string(hosts.front().size()) +
                           " and " + std::to_string(h.size()) + " ranks: set hsdp_shard_size");
      shards = hosts;
    } else {
      if (world % shard_size_ != 0)
        throw UsageError("hsdp_shard_size " + std::to_string(shard_size_) + " does not divide the " +
                         std::to_string(world) + " ranks");
      for (int first = 0; first < world; first += static_cast<int>(shard_size_)) {
        shards.emplace_back();
        for (int r = first; r < first + shard_size_; ++r) shards.back().push_back(r);
      }
    }
    std::vector<int> host_of(world);
    for (size_t h = 0; h < hosts.size(); ++h)
      for (int r : hosts[h]) host_of[r] = static_cast<int>(h);
    auto level = [&](const std::vector<int>& g) {
      for (int r : g)
        if (host_of[r] != host_of[g.front()]) return "inter-node";
      return "intra-node";
    };
    size_t my_group = 0, my_index = 0;
    for (size_t g = 0; g < shards.size(); ++g)
      for (size_t i = 0; i < shards[g].size(); ++i)
        if (shards[g][i] == me) my_group = g, my_index = i;
    std::vector<int> replicas;
    for (const auto& g : shards) replicas.push_back(g[my_index]);
    shard_owned_ = comm_->split(shards[my_group], "hsdp-shard" + std::to_string(my_group), level(shards[my_group]));
    shard_comm_ = shard_owned_.get();
    if (replicas.size() > 1)
      replica_comm_ = comm_->split(replicas, "hsdp-replica" + std::to_string(my_index), level(replicas));
  }

  bool prefetch_, hybrid_;
  int64_t shard_size_;
  Communicator* shard_comm_ = nullptr;  // comm_ (zero3) or shard_owned_ (hsdp)
  std::unique_ptr<Communicator> shard_owned_, replica_comm_;
  std::vector<c10::intrusive_ptr<Unit>> units_;
  c10::intrusive_ptr<Unit> root_;
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

void ParallelStrategy::clip_grad_norm(const std::vector<torch::Tensor>& opt_params, double max_norm) {
  if (!comm_) {
    torch::nn::utils::clip_grad_norm_(opt_params, max_norm);
    return;
  }
  torch::NoGradGuard no_grad;
  torch::Tensor sq = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat));
  for (const auto& p : opt_params)
    if (p.grad().defined()) sq += p.grad().to(torch::kFloat).pow(2).sum().cpu();
  if (sliced_gradients()) gradient_group()->all_reduce(sq, /*average=*/false);
  const double norm = std::sqrt(sq.item<double>());
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1)
    for (const auto& p : opt_params)
      if (p.grad().defined()) p.grad().mul_(coef);
}

ExpectedModelState expected_model_state(const std::string& strategy, int64_t psi, int64_t P, int64_t K, int64_t N) {
  const double n = static_cast<double>(std::max<int64_t>(N, 1)), x = static_cast<double>(psi);
  const std::string p = std::to_string(P), k = std::to_string(K);
  ExpectedModelState e;
  double bytes = 0;
  if (strategy == "zero1") {
    bytes = 2.0 * P * x + K * x / n;
    e.formula = "(" + p + "+" + p + ")Ψ + " + k + "Ψ/N";
  } else if (strategy == "zero2") {
    bytes = P * x + (P + K) * x / n;
    e.formula = p + "Ψ + (" + p + "+" + k + ")Ψ/N";
  } else if (strategy == "zero3" || strategy == "hsdp") {  // hsdp: N is the shard group's size
    bytes = (2.0 * P + K) * x / n;
    e.formula = "(" + p + "+" + p + "+" + k + ")Ψ/N";
  } else {
    bytes = (2.0 * P + K) * x;
    e.formula = "(" + p + "+" + p + "+" + k + ")Ψ";
  }
  e.bytes = static_cast<int64_t>(std::llround(bytes));
  return e;
}

std::unique_ptr<ParallelStrategy> make_strategy(const std::string& name, Communicator* comm, double bucket_mb,
                                                bool prefetch, int64_t hsdp_shard_size) {
  if (name == "single") return std::make_unique<Single>();
  if (!comm) throw UsageError("parallel strategy '" + name + "' needs a process group");
  if (name == "ddp") return std::make_unique<Ddp>(comm, bucket_mb);
  if (name == "zero1") return std::make_unique<Zero12>(comm, 1, bucket_mb);
  if (name == "zero2") return std::make_unique<Zero12>(comm, 2, bucket_mb);
  if (name == "zero3") return std::make_unique<Zero3>(comm, prefetch);
  if (name == "hsdp") return std::make_unique<Zero3>(comm, prefetch, /*hybrid=*/true, hsdp_shard_size);
  throw UsageError("unknown parallel strategy '" + name + "'");
}

}  // namespace trainscope::suites
