#pragma once
// What the data-parallel strategies share, internal to suites/parallel: flat parameter buffers, storage
// that is freed and refilled under live views (FSDP's resize), the gradient-bucket records the
// communication probe gets, and the factories of the strategy files (replicate.cpp: ddp, zero1, zero2;
// fully_shard.cpp: zero3, hsdp).
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "suites/parallel/strategies.hpp"

namespace trainscope::suites::detail {

double now_s();
// Frees a buffer's memory while every view of it stays valid (FSDP's storage resize): autograd's
// saved references to a gathered parameter survive, and allocate_storage() refills the same storage.
void release_storage(const torch::Tensor& t);
void allocate_storage(const torch::Tensor& t);
int64_t bytes_of(const torch::Tensor& t);

// A list of parameters turned into views of one flat buffer, padded to a multiple of the world size
// so that every rank owns an equal slice. The flat buffer may hold another dtype than the parameters
// had (bf16 compute copies of fp32 masters): the parameters become views of it, in its dtype. Their
// gradients are views of `grad` when it has their dtype (else autograd returns them to the caller).
struct FlatParams {
  std::vector<torch::Tensor> params;
  torch::Tensor flat, grad;
  int64_t numel = 0, shard = 0;

  void build(const std::vector<torch::Tensor>& ps, int world, std::optional<at::ScalarType> dtype = std::nullopt,
             std::optional<at::ScalarType> grad_dtype = std::nullopt) {
    params = ps;
    for (const auto& p : ps) numel += p.numel();
    shard = (numel + world - 1) / world;
    torch::NoGradGuard no_grad;
    const auto opts = ps.front().options().dtype(dtype.value_or(ps.front().scalar_type()));
    flat = torch::zeros({shard * world}, opts);
    grad = torch::zeros({shard * world}, opts.dtype(grad_dtype.value_or(opts.dtype().toScalarType())));
    int64_t off = 0;
    for (auto& p : params) {
      const int64_t n = p.numel();
      flat.narrow(0, off, n).copy_(p.reshape(-1));
      p.set_data(flat.narrow(0, off, n).view(p.sizes()));
      if (grad.scalar_type() == flat.scalar_type()) p.mutable_grad() = grad.narrow(0, off, n).view(p.sizes());
      off += n;
    }
  }
  torch::Tensor slice(const torch::Tensor& buf, int rank) const { return buf.narrow(0, rank * shard, shard); }
  // The ranges of `rank`'s slice (offsets within it) that hold the parameters in `keep`.
  std::vector<std::pair<int64_t, int64_t>> ranges_in_slice(int rank, const std::set<const void*>& keep) const {
    std::vector<std::pair<int64_t, int64_t>> out;
    const int64_t lo = rank * shard, hi = lo + shard;
    int64_t off = 0;
    for (const auto& p : params) {
      const int64_t begin = std::max(off, lo) - lo, end = std::min(off + p.numel(), hi) - lo;
      off += p.numel();
      if (begin >= end || !keep.count(p.unsafeGetTensorImpl())) continue;
      if (!out.empty() && out.back().second == begin) out.back().second = end;
      else out.emplace_back(begin, end);
    }
    return out;
  }
};

// zero1 and zero2 before a step: the flat gradient buffer allocated (it is freed once reduced) and
// zeroed, with the slice's gradient the optimizer reads.
void zero_flat_gradients(FlatParams& fp, const torch::Tensor& shard);

// The parameters' values in `dtype`, flat and padded to `world` equal slices (masters' source: taken
// before build() rounds the parameters to a lower compute dtype).
torch::Tensor flat_values(const std::vector<torch::Tensor>& ps, int world, at::ScalarType dtype);

// A leaf tensor the optimizer owns: this rank's slice of a flat buffer, sharing its memory (zero1/2:
// the step updates the flat parameters in place) or a copy (zero3: the flat buffer is freed at rest).
torch::Tensor optimizer_slice(const torch::Tensor& data, bool share);

// Rank 0's floating-point buffers (BatchNorm statistics) on every rank.
void broadcast_buffers(Communicator& comm, ReferenceModel& model);

// One gradient bucket's collective, launched on the autograd thread and completed on a Gloo/NCCL thread.
struct BucketRecord {
  int64_t bytes = 0;
  double start = 0, end = 0;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;  // for the device clock (NCCL's CUDA events)
};

// Reports a backward's bucket collectives once backward() has returned (having waited for every
// bucket). What came after the last launch (the last gradient ready) was the step waiting on
// communication: the exposed part, charged to the last bucket. On NCCL the host saw only launches:
// the durations wait for the device clock (Communicator::report_after), and the device timeline
// (`timeline = true`) has the exposed part.
void report_buckets(Communicator& comm, const std::string& op, std::vector<BucketRecord>& recs, double backward_end);

std::unique_ptr<ParallelStrategy> make_ddp(Communicator* comm, double bucket_mb);
std::unique_ptr<ParallelStrategy> make_zero12(Communicator* comm, int stage, double bucket_mb, const ParamPolicy& policy);
// Units of a block's (or the root's) parameters: zero3 over `shard` (the dp_shard group), hsdp when
// `replicas` (the dp_replicate group) is given too; with masters and no shard group, FSDP2's replicate
// (ddp: `replicas` only) or one process (neither).
std::unique_ptr<ParallelStrategy> make_fully_shard(Communicator* world, Communicator* shard, Communicator* replicas, bool prefetch,
                                                   const ParamPolicy& policy);

}  // namespace trainscope::suites::detail
