#include "suites/parallel/context_parallel.hpp"

#include <chrono>
#include <cstdint>

#include "core/errors.hpp"
#include "suites/parallel/comm.hpp"

namespace trainscope::suites::context_parallel {
namespace {

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// ---- One block: the CPU flash op, with grouped-query keys and values expanded as HF's repeat_kv ----

torch::Tensor expand_heads(const torch::Tensor& x, int64_t n_rep) {
  if (n_rep == 1) return x;
  const int64_t b = x.size(0), kv = x.size(1), s = x.size(2), d = x.size(3);
  return x.unsqueeze(2).expand({b, kv, n_rep, s, d}).reshape({b, kv * n_rep, s, d});
}

// Sums and merges run in fp32 at least (fp64 stays fp64).
at::ScalarType accumulation(at::ScalarType t) { return at::promote_types(t, torch::kFloat); }

// The gradient of the expanded heads summed back onto each key/value head, in the accumulation dtype.
torch::Tensor fold_heads(const torch::Tensor& g, int64_t kv_heads) {
  const torch::Tensor f = g.to(accumulation(g.scalar_type()));
  if (g.size(1) == kv_heads) return f;
  return f.view({g.size(0), kv_heads, g.size(1) / kv_heads, g.size(2), g.size(3)}).sum(2);
}

struct Block {
  torch::Tensor out, lse;  // out in the inputs' dtype, lse fp32 [B, H, L]
};

Block block_forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, bool causal, double scale) {
  const int64_t n_rep = q.size(1) / k.size(1);
  auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, expand_heads(k, n_rep), expand_heads(v, n_rep), 0.0,
                                                                     causal, std::nullopt, scale);
  return {out, lse};
}

struct BlockGrad {
  torch::Tensor dq, dk, dv;  // in the accumulation dtype; dk, dv with the key/value heads
};

BlockGrad block_backward(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& out, const torch::Tensor& lse, bool causal,
                         double scale) {
  const int64_t n_rep = q.size(1) / k.size(1);
  auto [dq, dk, dv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
      dout, q, expand_heads(k, n_rep), expand_heads(v, n_rep), out, lse, 0.0, causal, std::nullopt, scale);
  return {dq.to(accumulation(dq.scalar_type())), fold_heads(dk, k.size(1)), fold_heads(dv, k.size(1))};
}

// ---- The ring: what rank r computes at step i, against the block of rank s = (r - i) mod W ----

enum class Part { Causal, Full, FirstKeys, LastQueries, Skip };

Part ring_part(int64_t r, int64_t i, int64_t W, bool balance) {
  if (i == 0) return Part::Causal;                // its own tokens
  const int64_t s = ((r - i) % W + W) % W;
  if (!balance) return s < r ? Part::Full : Part::Skip;  // earlier tokens whole, later ones masked out
  // Head-tail: an earlier rank's front chunk precedes both of this rank's chunks, and its back chunk
  // follows both; a later rank's two chunks both precede this rank's back chunk only.
  return s < r ? Part::FirstKeys : Part::LastQueries;
}

struct Rows {
  int64_t begin, count;
};
Rows query_rows(Part p, int64_t c) { return p == Part::LastQueries ? Rows{c / 2, c / 2} : Rows{0, c}; }
int64_t key_count(Part p, int64_t c) { return p == Part::FirstKeys ? c / 2 : c; }

// The running output and log-sum-exp of one rank's queries (in the accumulation dtype).
struct Merged {
  torch::Tensor out, lse;
  void add(const Block& b, Rows rows) {
    if (!out.defined()) {
      out = b.out.to(accumulation(b.out.scalar_type()));
      lse = b.lse.clone();
      return;
    }
    torch::Tensor o = out.narrow(2, rows.begin, rows.count), l = lse.narrow(2, rows.begin, rows.count);
    o.sub_(torch::sigmoid(b.lse - l).unsqueeze(-1) * (o - b.out.to(o.scalar_type())));
    l.sub_(torch::log_sigmoid(l - b.lse));
  }
};

// What travels around the ring: a rank's keys and values and, in backward, their gradients' running sums.
struct Visiting {
  torch::Tensor k, v, dk, dv;
};

void forward_step(const torch::Tensor& q, const Visiting& at, Part part, double scale, Merged& m) {
  if (part == Part::Skip) return;
  const int64_t c = q.size(2);
  const Rows rows = query_rows(part, c);
  const int64_t keys = key_count(part, c);
  const Block b = block_forward(q.narrow(2, rows.begin, rows.count), at.k.narrow(2, 0, keys), at.v.narrow(2, 0, keys),
                                part == Part::Causal, scale);
  m.add(b, rows);
}

// Saved by forward for backward: this rank's queries and keys/values, the merged output and lse.
struct Saved {
  torch::Tensor q, k, v, out, lse;
};

void backward_step(const torch::Tensor& dout, const Saved& s, Visiting& at, Part part, double scale, torch::Tensor& dq) {
  if (part == Part::Skip) return;
  const int64_t c = s.q.size(2);
  const Rows rows = query_rows(part, c);
  const int64_t keys = key_count(part, c);
  auto slice = [&](const torch::Tensor& t) { return t.narrow(2, rows.begin, rows.count); };
  const BlockGrad g = block_backward(slice(dout), slice(s.q), at.k.narrow(2, 0, keys), at.v.narrow(2, 0, keys), slice(s.out),
                                     slice(s.lse), part == Part::Causal, scale);
  slice(dq).add_(g.dq);
  at.dk.narrow(2, 0, keys).add_(g.dk);
  at.dv.narrow(2, 0, keys).add_(g.dv);
}

torch::Tensor gathered_positions(int64_t S, int64_t W, bool balance, const torch::Device& device) {
  std::vector<torch::Tensor> all;
  for (int64_t r = 0; r < W; ++r) all.push_back(positions(S, r, W, balance));
  return torch::cat(all).to(device);
}

// ---- The communication of one rank ----

class Ring {
 public:
  explicit Ring(const ContextParallel& cp) : cp_(cp) {}
  // Posts sending `out` to the next rank and receiving `in` from the previous one; wait() completes them.
  void post(const std::vector<torch::Tensor>& out, const std::vector<torch::Tensor>& in) {
    const int next = static_cast<int>((cp_.rank + 1) % cp_.degree), prev = static_cast<int>((cp_.rank + cp_.degree - 1) % cp_.degree);
    posted_ = now_s();
    for (size_t i = 0; i < out.size(); ++i) {
      works_.push_back(cp_.group->send(out[i], next, tag_));
      works_.push_back(cp_.group->recv(in[i], prev, tag_++));
      bytes_ += out[i].numel() * static_cast<int64_t>(out[i].element_size());
    }
  }
  void wait() {
    const double t0 = now_s();
    for (auto& w : works_) {
      w->wait();
      if (cp_.group->backend() == "gloo") release_on_this_thread(w);
    }
    const double t1 = now_s();
    if (!works_.empty()) {
      cp_.group->report(CollectiveInfo{"send", bytes_, 2, t1 - posted_, t1 - t0, cp_.group->step(), 0.0, "", ""});
      cp_.stats->wait_s += t1 - t0;
      cp_.stats->transfer_s += t1 - posted_;
      cp_.stats->bytes += bytes_;
    }
    works_.clear();
    bytes_ = 0;
  }

 private:
  const ContextParallel& cp_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  int64_t bytes_ = 0;
  int tag_ = 0;
  double posted_ = 0;
};

std::vector<torch::Tensor> empties_like(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(torch::empty_like(t, at::MemoryFormat::Contiguous));
  return out;
}

// Every rank's keys and values (one flat all-gather; block r is rank r's).
std::vector<Visiting> all_gather_kv(const torch::Tensor& k, const torch::Tensor& v, const ContextParallel& cp) {
  const torch::Tensor mine = torch::cat({k.contiguous().reshape({-1}), v.contiguous().reshape({-1})});
  torch::Tensor full = torch::empty({mine.numel() * cp.degree}, mine.options());
  const double t0 = now_s();
  cp.group->all_gather(full, mine);  // blocking: all of it exposed
  cp.stats->wait_s += now_s() - t0;
  cp.stats->transfer_s += now_s() - t0;
  cp.stats->bytes += mine.numel() * static_cast<int64_t>(mine.element_size()) * (cp.degree - 1);
  std::vector<Visiting> blocks;
  for (const torch::Tensor& part : full.chunk(cp.degree))
    blocks.push_back({part.narrow(0, 0, k.numel()).view(k.sizes()), part.narrow(0, k.numel(), v.numel()).view(v.sizes()), {}, {}});
  return blocks;
}

// ---- Autograd: one node per attention call, its backward the ring's (or the gather's) ----

struct Setup {
  const ContextParallel* cp = nullptr;  // null: the emulation
  int64_t degree = 1;
  std::string method;
  bool balance = true;
  double scale = 1.0;
};

// One rank's forward and backward over the cp group. The ring passes each rank's keys and values on while
// the current block computes; the all-gather (torch's default rotation, _AllGatherRotater) fetches them
// all at once and walks the same blocks, so both compute the same bits. In backward the gradients' sums
// go around the ring in both (the gather's keys and values gathered again: only the local ones are kept).
struct RankAttention {
  static std::pair<torch::Tensor, Saved> forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const Setup& s) {
    const ContextParallel& cp = *s.cp;
    const int64_t W = cp.degree;
    const bool gathered = s.method == "allgather";
    const std::vector<Visiting> all = gathered ? all_gather_kv(k, v, cp) : std::vector<Visiting>{};
    Ring ring(cp);
    Visiting at = gathered ? all[static_cast<size_t>(cp.rank)] : Visiting{k.contiguous(), v.contiguous(), {}, {}};
    Merged m;
    for (int64_t i = 0; i < W; ++i) {
      Visiting next;
      if (i + 1 < W) {
        if (gathered) {
          next = all[static_cast<size_t>((cp.rank - i - 1 + W) % W)];
        } else {  // the next block travels while this one computes
          const auto in = empties_like({at.k, at.v});
          ring.post({at.k, at.v}, in);
          next = {in[0], in[1], {}, {}};
        }
      }
      forward_step(q, at, ring_part(cp.rank, i, W, s.balance), s.scale, m);
      ring.wait();
      if (i + 1 < W) at = next;
    }
    const torch::Tensor out = m.out.to(q.scalar_type());
    return {out, Saved{q, k, v, out, m.lse}};
  }

  static std::vector<torch::Tensor> backward(const torch::Tensor& dout, const Saved& sv, const Setup& s) {
    const ContextParallel& cp = *s.cp;
    const int64_t W = cp.degree;
    const bool gathered = s.method == "allgather";
    const std::vector<Visiting> all = gathered ? all_gather_kv(sv.k, sv.v, cp) : std::vector<Visiting>{};
    Ring ring(cp);
    const auto acc = torch::TensorOptions().dtype(accumulation(sv.k.scalar_type())).device(sv.k.device());
    Visiting at = gathered ? all[static_cast<size_t>(cp.rank)] : Visiting{sv.k.contiguous(), sv.v.contiguous(), {}, {}};
    at.dk = torch::zeros(sv.k.sizes(), acc);
    at.dv = torch::zeros(sv.v.sizes(), acc);
    torch::Tensor dq = torch::zeros(sv.q.sizes(), acc);
    for (int64_t i = 0; i < W; ++i) {
      Visiting next;
      if (i + 1 < W) {
        if (gathered) {
          next = all[static_cast<size_t>((cp.rank - i - 1 + W) % W)];
        } else {  // the keys and values go on while this block computes
          const auto in = empties_like({at.k, at.v});
          ring.post({at.k, at.v}, in);
          next = {in[0], in[1], {}, {}};
        }
      }
      backward_step(dout, sv, at, ring_part(cp.rank, i, W, s.balance), s.scale, dq);
      // Their gradients' sums follow once this rank has added its part; after the last step they reach
      // their owner, the next rank.
      const auto grad_in = empties_like({at.dk, at.dv});
      ring.post({at.dk, at.dv}, grad_in);
      ring.wait();
      at = {next.k, next.v, grad_in[0], grad_in[1]};
    }
    return {dq.to(sv.q.scalar_type()), at.dk.to(sv.k.scalar_type()), at.dv.to(sv.v.scalar_type())};
  }
};

// Every virtual rank in one process, the same steps in the same order.
struct Emulated {
  static std::vector<torch::Tensor> shards(const torch::Tensor& x, const Setup& s) {
    std::vector<torch::Tensor> out;
    for (int64_t r = 0; r < s.degree; ++r)
      out.push_back(x.index_select(2, positions(x.size(2), r, s.degree, s.balance).to(x.device())));
    return out;
  }
  static torch::Tensor unshard(const std::vector<torch::Tensor>& parts, const Setup& s) {
    const torch::Tensor cat = torch::cat(parts, 2);
    torch::Tensor out = torch::empty_like(cat);
    out.index_copy_(2, gathered_positions(cat.size(2), s.degree, s.balance, cat.device()), cat);
    return out;
  }

  static std::pair<torch::Tensor, std::vector<Saved>> forward(const torch::Tensor& q, const torch::Tensor& k,
                                                              const torch::Tensor& v, const Setup& s) {
    const auto qs = shards(q, s), ks = shards(k, s), vs = shards(v, s);
    const int64_t W = s.degree;
    std::vector<Merged> m(static_cast<size_t>(W));
    for (int64_t i = 0; i < W; ++i)
      for (int64_t r = 0; r < W; ++r)
        forward_step(qs[r], Visiting{ks[(r - i + W) % W], vs[(r - i + W) % W], {}, {}}, ring_part(r, i, W, s.balance), s.scale,
                     m[static_cast<size_t>(r)]);
    std::vector<Saved> saved;
    std::vector<torch::Tensor> outs;
    for (int64_t r = 0; r < W; ++r) {
      outs.push_back(m[r].out.to(q.scalar_type()));
      saved.push_back(Saved{qs[r], ks[r], vs[r], outs.back(), m[r].lse});
    }
    return {unshard(outs, s), saved};
  }

  static std::vector<torch::Tensor> backward(const torch::Tensor& dout, const std::vector<Saved>& sv, const Setup& s) {
    const int64_t W = s.degree;
    const auto douts = shards(dout, s);
    const auto acc = torch::TensorOptions().dtype(accumulation(dout.scalar_type())).device(dout.device());
    std::vector<Visiting> at;
    std::vector<torch::Tensor> dq, dk, dv;
    for (int64_t r = 0; r < W; ++r) {
      at.push_back(Visiting{sv[r].k, sv[r].v, torch::zeros(sv[r].k.sizes(), acc), torch::zeros(sv[r].v.sizes(), acc)});
      dq.push_back(torch::zeros(sv[r].q.sizes(), acc));
    }
    for (int64_t i = 0; i < W; ++i) {
      for (int64_t r = 0; r < W; ++r) backward_step(douts[r], sv[r], at[r], ring_part(r, i, W, s.balance), s.scale, dq[r]);
      std::rotate(at.rbegin(), at.rbegin() + 1, at.rend());  // each rank's block moves on to the next rank
    }
    for (int64_t r = 0; r < W; ++r) {
      dq[r] = dq[r].to(sv[r].q.scalar_type());
      dk.push_back(at[r].dk.to(sv[r].k.scalar_type()));
      dv.push_back(at[r].dv.to(sv[r].v.scalar_type()));
    }
    return {unshard(dq, s), unshard(dk, s), unshard(dv, s)};
  }
};

class CpAttention : public torch::autograd::Function<CpAttention> {
 public:
  static constexpr int kSaved = 5;  // q, k, v, out, lse per rank
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const Setup& s) {
    const double t0 = now_s();
    torch::Tensor out;
    std::vector<Saved> saved;
    if (s.cp) {
      auto [o, sv] = RankAttention::forward(q, k, v, s);
      out = o;
      saved.push_back(sv);
    } else {
      std::tie(out, saved) = Emulated::forward(q, k, v, s);
    }
    std::vector<torch::Tensor> keep;
    for (const Saved& sv : saved) keep.insert(keep.end(), {sv.q, sv.k, sv.v, sv.out, sv.lse});
    ctx->save_for_backward(keep);
    // The layout lives as long as the model that calls this (the block's ContextParallel).
    ctx->saved_data["cp"] = reinterpret_cast<int64_t>(s.cp);
    ctx->saved_data["degree"] = s.degree;
    ctx->saved_data["method"] = s.method;
    ctx->saved_data["balance"] = s.balance;
    ctx->saved_data["scale"] = s.scale;
    if (s.cp) s.cp->stats->attention_s += now_s() - t0;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    Setup s;
    s.cp = reinterpret_cast<const ContextParallel*>(ctx->saved_data["cp"].toInt());
    s.degree = ctx->saved_data["degree"].toInt();
    s.method = ctx->saved_data["method"].toStringRef();
    s.balance = ctx->saved_data["balance"].toBool();
    s.scale = ctx->saved_data["scale"].toDouble();
    const auto kept = ctx->get_saved_variables();
    std::vector<Saved> saved;
    for (size_t i = 0; i + kSaved <= kept.size(); i += kSaved) saved.push_back(Saved{kept[i], kept[i + 1], kept[i + 2], kept[i + 3], kept[i + 4]});
    const double t0 = now_s();
    const torch::Tensor dout = grads[0].contiguous();
    const std::vector<torch::Tensor> g = s.cp ? RankAttention::backward(dout, saved[0], s) : Emulated::backward(dout, saved, s);
    if (s.cp) s.cp->stats->attention_s += now_s() - t0;
    return {g[0], g[1], g[2], torch::Tensor()};
  }
};

void check(const torch::Tensor& q, const torch::Tensor& k, const std::string& method, int64_t degree) {
  if (method != "ring" && method != "allgather") throw UsageError("cp_method '" + method + "': expected ring or allgather");
  if (!q.device().is_cpu())
    throw UsageError("cp's attention runs LibTorch's CPU flash kernel in this build; its CUDA kernels (flash or efficient "
                     "attention with the log-sum-exp) are not wired yet");
  if (q.size(1) % k.size(1) != 0) throw UsageError("cp attention: query heads are not a multiple of the key/value heads");
  if (degree > 1 && q.size(2) % 2 != 0) throw UsageError("cp attention: a rank's tokens must split into two equal chunks");
}

}  // namespace

torch::Tensor positions(int64_t S, int64_t rank, int64_t degree, bool balance) {
  if (S % (2 * degree) != 0)
    throw UsageError("cp " + std::to_string(degree) + " needs the sequence (" + std::to_string(S) + ") in 2 x cp equal chunks");
  const auto opts = torch::TensorOptions().dtype(torch::kLong);
  if (!balance) return torch::arange(rank * (S / degree), (rank + 1) * (S / degree), opts);
  const int64_t h = S / (2 * degree);
  return torch::cat({torch::arange(rank * h, (rank + 1) * h, opts), torch::arange((2 * degree - 1 - rank) * h, (2 * degree - rank) * h, opts)});
}

torch::Tensor shard(const torch::Tensor& x, int64_t dim, const ContextParallel& cp) {
  if (!cp.active()) return x;
  return x.index_select(dim, positions(x.size(dim), cp.rank, cp.degree, cp.balance).to(x.device()));
}

torch::Tensor attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale,
                        const ContextParallel& cp) {
  check(q, k, cp.method, cp.degree);
  if (!cp.group) throw UsageError("cp attention: no cp communicator");
  return CpAttention::apply(q, k, v, Setup{&cp, cp.degree, cp.method, cp.balance, scale});
}

torch::Tensor emulate(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double scale, int64_t degree,
                      const std::string& method, bool balance) {
  check(q, k, method, 2);
  return CpAttention::apply(q, k, v, Setup{nullptr, degree, method, balance, scale});
}

}  // namespace trainscope::suites::context_parallel
