#include "plan/models.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/errors.hpp"
#include "core/layout.hpp"
#include "core/precision.hpp"

namespace trainscope::plan {

Numerics numerics_of(const std::string& precision, bool cuda, const std::string& reduce_dtype) {
  const PrecisionTraits& t = precision_traits(precision);
  Numerics n;
  n.precision = precision;
  n.param = dtype_bytes(t.params);
  n.master = t.master.empty() ? 0 : dtype_bytes(t.master);
  n.reduce = dtype_bytes(t.master.empty() ? t.reduce : reduce_dtype);
  n.fp16_emulated = fp16_emulated(t, cuda);
  n.autocast = !t.autocast.empty() && !n.fp16_emulated;
  n.low = t.autocast.empty() ? 2 : dtype_bytes(t.autocast);
  n.scaler = t.loss_scaler;
  n.fp8 = t.fp8_linear;
  n.gemm_dtype = compute_dtype(t, cuda);
  return n;
}

int64_t ParamLayout::total() const {
  int64_t n = std::accumulate(root.begin(), root.end(), int64_t{0});
  for (const auto& b : blocks) n += std::accumulate(b.begin(), b.end(), int64_t{0});
  return n;
}
int64_t ParamLayout::largest() const {
  int64_t m = 0;
  for (int64_t v : root) m = std::max(m, v);
  for (const auto& b : blocks)
    for (int64_t v : b) m = std::max(m, v);
  return m;
}

std::string replay_unsupported(const ModelShape& m) {
  if (m.family == "gpt" || m.family == "llama" || m.family == "mlp" || m.family == "cnn") return "";
  return "the planner covers mlp, cnn, gpt and llama models; " + m.name + " is a " + m.family;
}

std::string replay_unsupported(const Replay& r) {
  if (std::string why = replay_unsupported(r.model); !why.empty()) return why;
  if (r.tp > 1 && !r.model.language_model()) return "tensor parallelism splits decoders; " + r.model.name + " is a " + r.model.family;
  if (!r.held.empty() && !r.model.language_model()) return "pipeline parallelism splits decoders; " + r.model.name + " is a " + r.model.family;
  return "";
}

bool Replay::holds(int64_t layer) const {
  if (held.empty()) return true;
  return std::any_of(held.begin(), held.end(), [layer](const auto& h) { return h.first <= layer && layer < h.second; });
}

int64_t Replay::held_layers() const {
  if (held.empty()) return model.layers;
  int64_t n = 0;
  for (const auto& [first, last] : held) n += last - first;
  return n;
}

namespace {

// Output element bytes of a binary op: type promotion, which for these dtypes is the wider one.
int wider(const T& a, const T& b) { return std::max(a.elem, b.elem); }

// The operators the models use, with what autograd saves for each (derivatives.yaml): a product
// saves the factor whose gradient needs the other; LayerNorm saves input, mean and rstd; softmax and
// log_softmax their output; GELU and SiLU their input; ReLU its output; matmul both operands.
struct Net {
  Tape& t;
  const Replay& r;
  const Numerics& num;

  OpCost ew(int64_t bytes) const { return OpCost{0, 0, 0, 1, bytes}; }
  static OpCost act(OpKind k, const T& x) { return elementwise_cost(k, x.numel, x.elem); }
  // Autocast's cast of a GEMM operand to the low dtype (a new tensor; no-op when already low).
  T lower(const T& x) {
    if (!num.autocast || x.elem == num.low) return x;
    if (x.param) {
      auto hit = t.autocast_cache.find(x.id);
      if (hit != t.autocast_cache.end()) return hit->second;
      T c = t.op({&x}, x.numel, num.low, {}, false, 0, ew(x.bytes() + x.numel * num.low));
      t.autocast_cache.emplace(x.id, c);
      return c;
    }
    return t.op({&x}, x.numel, num.low, {}, false, 0, ew(x.bytes() + x.numel * num.low));
  }
  T cast(const T& x, int elem) {
    if (x.elem == elem) return x;
    return t.op({&x}, x.numel, elem, {}, false, 0, ew(x.bytes() + x.numel * elem));
  }
  // aten::linear over [rows, in] (addmm): saves the input and the weight, both as autocast passes them.
  // Library scratch of one GEMM with inner dimension k in this element size (oneDNN's, on a CPU).
  int64_t workspace(int elem, int64_t k) const {
    auto c = r.gemm_workspace.find(elem);
    return c == r.gemm_workspace.end() || c->second.empty() ? 0 : static_cast<int64_t>(c->second.at(static_cast<double>(k)));
  }
  T linear(const T& x, const T& w, const T* b, int64_t rows, int64_t in, int64_t out) {
    const T xc = lower(x), wc = lower(w);
    const T bc = b ? lower(*b) : T();
    // Backward: the input gradient's GEMM (inner dimension out) and the weight's (inner dimension rows).
    const int64_t backward_ws = std::max(workspace(xc.elem, out), workspace(xc.elem, rows));
    const bool keep = sac_keeps_linear(b != nullptr);
    if (keep && t.sac->recompute) return t.served({&xc, &wc, b ? &bc : nullptr}, served()[0], {&xc, &wc}, backward_ws);
    T y = t.op({&xc, &wc, b ? &bc : nullptr}, rows * out, xc.elem, {&xc, &wc}, false, 0, gemm_cost(rows, out, in),
               workspace(xc.elem, in), backward_ws);
    if (keep) t.sac->kept.push_back({y});
    return y;
  }
  // selective-op (suites/techniques/checkpoint.cpp: sac_linear): a biased linear (addmm) is kept, an
  // unbiased one (mm) every second time, counting from the block's first.
  bool sac_keeps_linear(bool biased) {
    if (!t.sac) return false;
    return biased || ++t.sac->mm % 2 == 1;
  }
  const std::vector<T>& served() { return t.sac->kept.at(t.sac->next++); }
  // A batched matmul of attention (bmm, selective-op keeps it): a x b over `saved` operands.
  T bmm(const T& a, const T& b, int64_t out, const OpCost& cost) {
    if (t.sac && t.sac->recompute) return t.served({&a, &b}, served()[0], {&a, &b});
    T y = t.op({&a, &b}, out, a.elem, {&a, &b}, false, 0, cost);
    if (t.sac) t.sac->kept.push_back({y});
    return y;
  }
  // The fused attention kernel: saves q, k, v, its output and the fp32 log-sum-exp; selective-op keeps
  // the output and log-sum-exp where the kernel is flash without dropout, on a CPU or without grouped
  // K/V on a GPU (sac_attention).
  T attention(const T& q, const T& k, const T& v, int64_t out, int64_t lse, const OpCost& cost, bool grouped, double dropout) {
    const bool keep = t.sac && dropout <= 0 && !(r.cuda && grouped);
    if (keep && t.sac->recompute) {
      const std::vector<T>& kept = served();
      return t.served({&q, &k, &v}, kept[0], {&q, &k, &v, &kept[0], &kept[1]});
    }
    T y = t.op({&q, &k, &v}, out, q.elem, {&q, &k, &v}, true, lse, cost);
    if (keep) t.sac->kept.push_back({y, t.data(lse / 4, 4)});
    return y;
  }
  // Context parallelism's attention (suites/parallel/context_parallel.cpp: CpAttention over RankAttention):
  // one autograd node over this rank's c tokens that saves q, k, v, its output and the log-sum-exp (in the
  // accumulation dtype, fp32 at least). Forward's scratch: the keys and values made contiguous and the
  // next block's (the ring's receive buffers; with the all-gather every rank's at once and the flat
  // send buffer), the running output and lse, a block's expanded heads (grouped-query) with its output
  // and lse, and the merge's temporaries; backward's: the output gradient made contiguous, the keys and
  // values again, the gradient sums travelling and arriving, the running dq, and a block's expanded
  // heads, its kernel gradients and their accumulation-dtype copies. The cost: cp_attention_layer_cost.
  T cp_attention(const T& q, const T& k, const T& v, int64_t B, int64_t Hq, int64_t Hkv, int64_t Dh) {
    const int e = q.elem, a = std::max(e, 4);
    const int64_t W = r.cp, c = r.local_seq();
    const int64_t kv = B * Hkv * c * Dh * e, qo = B * Hq * c * Dh, lse = B * Hq * c * a;
    const int64_t expanded = Hq == Hkv ? 0 : 2 * B * Hq * c * Dh * e;
    const int64_t held = r.cp_method == "allgather" ? 2 * kv * W + 2 * kv : 4 * kv;
    const int64_t fwd = held + qo * a + lse + std::max(expanded + qo * e + lse, qo * e + lse + 2 * qo * a);
    const int64_t sums = 4 * B * Hkv * c * Dh * a;
    const int64_t bwd = qo * e + held + sums + qo * a + std::max(expanded + 3 * qo * e, 3 * qo * e + 2 * qo * a);
    return t.op({&q, &k, &v}, qo, e, {&q, &k, &v}, true, lse, cp_attention_layer_cost(r, B), fwd, bwd);
  }
  // A copy making a strided view contiguous (matmul's reshape of a permuted operand, .contiguous()).
  T copy(const T& x) { return t.op({&x}, x.numel, x.elem, {}, false, 0, ew(2 * x.bytes())); }
  T layer_norm(const T& x, const T& w, const T& b, int64_t rows) {
    return t.op({&x, &w, &b}, x.numel, x.elem, {&x}, false, 2 * rows * 4, act(OpKind::Norm, x));
  }
  // GELU and SiLU save their input, ReLU and softmax their output.
  T unary(const T& x, bool save_in, bool save_out, OpKind kind = OpKind::Memory) {
    return t.op({&x}, x.numel, x.elem, {save_in ? &x : nullptr}, save_out, 0,
                kind == OpKind::Memory ? ew(2 * x.bytes()) : act(kind, x));
  }
  T add(const T& a, const T& b) {
    const int64_t n = std::max(a.numel, b.numel);
    T o = t.op({&a, &b}, n, wider(a, b), {}, false, 0, ew(3 * n * wider(a, b)));
    t.mark_passthrough();  // AddBackward returns the incoming gradient for both (same size and dtype)
    return o;
  }
  // a * b where each factor is saved only if the other's gradient is wanted.
  T mul(const T& a, const T& b) {
    const int64_t n = std::max(a.numel, b.numel);
    return t.op({&a, &b}, n, wider(a, b), {b.grad() ? &a : nullptr, a.grad() ? &b : nullptr}, false, 0,
                ew(3 * n * wider(a, b)));
  }
  T scale(const T& x) { return t.op({&x}, x.numel, x.elem, {}, false, 0, ew(2 * x.bytes())); }  // x * c, x / c
  // Dropout on a CPU (ATen's _dropout_impl): a noise tensor of the input's dtype, saved by the product.
  T dropout(const T& x, double p) {
    if (p <= 0) return x;
    const T noise = t.data(x.numel, x.elem);
    t.cost(act(OpKind::Random, x));  // bernoulli_ draws the mask
    return mul(x, noise);
  }
  // CPU 16-mixed: a block output rounded through fp16 (RoundFp16: a half temporary, a new tensor).
  T boundary(const T& x) {
    if (!num.fp16_emulated) return x;
    t.transient(x.numel * 2);
    return t.op({&x}, x.numel, x.elem, {}, false, 0, ew(2 * x.bytes()));
  }
  // ---- tensor parallelism (suites/parallel/tensor_parallel.cpp) ----
  bool sequence_parallel() const { return r.tp > 1 && r.sequence_parallel; }
  // Megatron's f: Copy (a view; backward all-reduces the gradient) or, with sequence parallelism, the
  // all-gather of the sequence shards into a new tensor, which the projections save.
  T enter(const T& x) {
    if (!sequence_parallel()) return x;
    return t.op({&x}, x.numel * r.tp, x.elem, {}, false, 0, ew((r.tp + 1) * x.bytes()));
  }
  // Megatron's g after a row-parallel layer: the all-reduce of a clone of the partial sums, or the
  // reduce-scatter of a contiguous copy (scratch) into this rank's sequence shard.
  T leave(const T& partial) {
    if (r.tp == 1) return partial;
    if (!sequence_parallel()) return t.op({&partial}, partial.numel, partial.elem, {}, false, 0, ew(2 * partial.bytes()));
    return t.op({&partial}, partial.numel / r.tp, partial.elem, {}, false, 0, ew(3 * partial.bytes()), partial.bytes());
  }
  // vocab_embedding over N tokens: the tokens outside this rank's rows masked (a bool mask and int64 local
  // ids, saved by the masked fill and the lookup), the lookup zeroed there, then `leave`.
  T vocab_embedding(const T& table, int64_t tokens) {
    const int64_t D = r.model.width, e = r.num.param;
    const T outside = t.data(tokens, 1), local = t.data(tokens, 8);
    t.transient(tokens * 2 + tokens * 8);  // the two comparisons and the subtraction before the fill
    const T looked = t.op({&table}, tokens * D, e, {&local}, false, 0, ew(tokens * D * e));
    return leave(t.op({&looked}, tokens * D, e, {&outside}, false, 0, ew(2 * tokens * D * e)));
  }
  // A biased row-parallel layer: the biased GEMM alone, or under tp the partial product (mm), its
  // reduction and then the bias (TransformerBlock::row_parallel).
  T row_parallel(const T& x, const T& w, const T& b, int64_t rows, int64_t in, int64_t out) {
    if (r.tp == 1) return linear(x, w, &b, rows, in, out);
    return add(leave(linear(x, w, nullptr, rows, in, out)), b);
  }
  // VocabCrossEntropy (DTensor's loss_parallel) on this rank's [rows, cols] logits: one autograd node
  // that saves the log-probabilities in fp32 at least (and each row's local target and mask); forward's
  // scratch is that copy of the logits (unless already in it) and the shifted logits beside them;
  // backward's the zeros, the exponentials and their sum before the scaled gradient it returns (cast
  // to the logits' dtype).
  T vocab_loss(const T& logits, int64_t rows, int64_t cols) {
    const int e = std::max(4, logits.elem);
    const int64_t nc = rows * cols * e, copy = logits.elem == e ? 0 : nc;
    OpCost cost = act(OpKind::Softmax, logits);
    return t.op({&logits}, 1, e, {}, false, nc + rows * 9, cost, copy + nc, 3 * nc + copy);
  }
  // ReferenceModel::loss: logits to fp32 at least, cross_entropy = log_softmax (saves its output) +
  // nll_loss; the logits die when loss() returns.
  T loss(const T& logits, int64_t rows, int64_t classes) {
    if (r.tp > 1) return vocab_loss(logits, rows, classes / r.tp);
    if (r.cross_entropy == "fused") return fused_loss(logits, rows, classes);
    const T l32 = cast(logits, std::max(4, logits.elem));
    const T logp = t.op({&l32}, rows * classes, l32.elem, {}, true, 0, act(OpKind::Softmax, l32));
    return t.op({&logp}, 1, 4, {}, false, 0, ew(logp.bytes()));
  }
  // FusedCrossEntropy: saves the logits and each row's fp32 log-sum-exp; forward and backward convert a
  // chunk of rows at a time (an fp32 copy unless already fp32, and the shifted exponentials), and backward
  // writes the logits' gradient in their dtype (the node's input gradient).
  T fused_loss(const T& logits, int64_t rows, int64_t classes) {
    const int64_t chunk = std::min(rows, std::max<int64_t>(1, kFusedLossChunkElements / classes));
    const int64_t scratch = chunk * classes * 4 * (logits.elem == 4 ? 1 : 2) + chunk * 4;  // + the row maxima
    const int64_t picked = rows * (logits.elem + 4 + 4);  // gather, its fp32 copy, lse - picked
    OpCost cost = act(OpKind::Softmax, logits);
    cost.bytes = logits.bytes();  // one read of the logits
    // The log-sum-exp (rows x 4, saved) is live under the forward's scratch.
    return t.op({&logits}, 1, 4, {&logits}, false, rows * 4, cost, rows * 4 + std::max(scratch, picked), scratch);
  }
};

// ---- GPT (suites/models/models.cpp: Gpt, TransformerBlock) ---------------------------------------
struct GptBlockParams {
  const T *ln1w, *ln1b, *qkvw, *qkvb, *projw, *projb, *ln2w, *ln2b, *fcw, *fcb, *fcpw, *fcpb;
};

T gpt_block(Net& n, const T& x, const GptBlockParams& p, bool selective) {
  Tape& t = n.t;
  const ModelShape& m = n.r.model;
  // Under tensor parallelism this rank's heads and fc units; x holds S / tp of the tokens with sequence
  // parallelism (TransformerBlock::forward).
  const int64_t tp = n.r.tp, B = n.r.batch, S = n.r.local_seq(), D = m.width / tp, H = m.heads / tp, N = B * S;
  const int64_t rows = x.numel / m.width;
  const double drop = m.dropout;
  const T qkv = n.linear(n.enter(n.layer_norm(x, *p.ln1w, *p.ln1b, rows)), *p.qkvw, p.qkvb, N, m.width, 3 * D);
  auto core = [n, B, S, D, H, N, drop, sdpa = m.attention == "sdpa"](Tape& t, const T& packed) mutable -> T {
    const T q = t.part(packed, N * D), k = t.part(packed, N * D), v = t.part(packed, N * D);
    const int e = packed.elem;
    if (n.r.cp > 1) return n.cp_attention(q, k, v, B, H, H, D / H);  // [B,S,H,Dh] in memory: the reshape is a view
    if (sdpa) {
      // The fused kernel saves q, k, v (views of qkv), its output and the log-sum-exp (fp32).
      const T out = n.attention(q, k, v, N * D, B * H * S * 4, attention_cost(S, D / H, B * H), false, drop);
      OpCost exps = elementwise_cost(OpKind::Softmax, B * H * S * S / 2, 4);  // the kernel's exponentials (causal half)
      exps.on_chip = true;
      t.cost(exps);
      return n.copy(out);  // .transpose(1, 2).reshape: a copy
    }
    T scores;
    {
      const T qc = n.copy(q), kc = n.copy(k);  // matmul's reshape of the permuted operands
      const T raw = n.bmm(qc, kc, B * H * S * S, gemm_cost(S, S, D / H, B * H));
      scores = n.scale(raw);
    }
    const T mask = t.data(S * S, 1);  // ones(S, S).triu(1): bool
    T att;
    {
      const T filled = t.op({&scores}, scores.numel, e, {&mask}, false, 0, n.ew(2 * scores.bytes()));
      att = n.unary(filled, false, true, OpKind::Softmax);  // softmax saves its output
    }
    att = n.dropout(att, drop);
    const T vc = n.copy(v);
    const T out = n.bmm(att, vc, N * D, gemm_cost(S, D / H, S, B * H));
    return n.copy(out);  // .transpose(1, 2).reshape: a copy
  };
  const T y = selective ? t.checkpoint(core, qkv, {}, {}) : core(t, qkv);
  const T h = n.add(x, n.dropout(n.row_parallel(y, *p.projw, *p.projb, N, D, m.width), drop));
  const T fc = n.linear(n.enter(n.layer_norm(h, *p.ln2w, *p.ln2b, rows)), *p.fcw, p.fcb, N, m.width, 4 * D);
  const T mlp = n.row_parallel(n.unary(fc, true, false, OpKind::Activation), *p.fcpw, *p.fcpb, N, 4 * D, m.width);
  return n.add(h, n.dropout(mlp, drop));
}

// ---- Llama (suites/models/llama.cpp) ---------------------------------------------------------------
T rms_norm(Net& n, const T& x, const T& w, int64_t rows) {
  Tape& t = n.t;
  T h = n.cast(x, 4);
  {
    T variance;
    {
      const T sq = t.op({&h}, h.numel, 4, {&h}, false, 0, n.ew(2 * h.bytes()));  // pow(2) saves its input
      variance = t.op({&sq}, rows, 4, {}, false, 0, n.ew(sq.bytes()));        // mean
    }
    const T eps = n.scale(variance);
    const T rs = t.op({&eps}, rows, 4, {}, true, 0, n.ew(2 * eps.bytes()));  // rsqrt saves its output
    h = n.mul(h, rs);
  }
  return n.mul(w, n.cast(h, x.elem));
}

T rotary(Net& n, const T& x) {  // apply_rotary: x * cos + rotate_half(x) * sin; cos/sin want no gradient
  Tape& t = n.t;
  const T x_cos = t.op({&x}, x.numel, x.elem, {}, false, 0, n.ew(3 * x.bytes()));
  T rotated;
  {
    const T neg = t.op({&x}, x.numel / 2, x.elem, {}, false, 0, n.ew(x.bytes()));
    const T cat = t.op({&neg, &x}, x.numel, x.elem, {}, false, 0, n.ew(2 * x.bytes()));
    rotated = t.op({&cat}, x.numel, x.elem, {}, false, 0, n.ew(3 * x.bytes()));
  }
  return n.add(x_cos, rotated);
}

struct LlamaBlockParams {
  const T *ln1, *q, *k, *v, *o, *ln2, *gate, *up, *down;
};

// Under tensor parallelism this rank's heads (key/value heads split when tp divides them, else the one
// head its query heads read) and FFN units; x holds S / tp of the tokens with sequence parallelism.
T llama_block(Net& n, const T& x, const LlamaBlockParams& p, bool selective) {
  Tape& t = n.t;
  const ModelShape& m = n.r.model;
  const int64_t tp = n.r.tp, B = n.r.batch, S = n.r.local_seq(), D = m.width, Dh = m.head_dim(), Hq = m.heads / tp;
  const int64_t Hkv = m.kv_heads % tp == 0 ? m.kv_heads / tp : 1;
  const int64_t N = B * S, F = m.ffn / tp, rows = x.numel / D;
  const T normed = n.enter(rms_norm(n, x, *p.ln1, rows));
  const T q = n.linear(normed, *p.q, nullptr, N, D, Hq * Dh);
  const T k = n.linear(normed, *p.k, nullptr, N, D, Hkv * Dh);
  const T v = n.linear(normed, *p.v, nullptr, N, D, Hkv * Dh);
  const T q_embed = rotary(n, q), k_embed = rotary(n, k);
  const int64_t rep = Hq / Hkv;
  auto core = [n, k_embed, v, B, S, Dh, Hq, Hkv, N, rep, sdpa = m.attention == "sdpa"](Tape& t, const T& query) mutable -> T {
    const int e = query.elem;
    if (n.r.cp > 1) return n.cp_attention(query, k_embed, v, B, Hq, Hkv, Dh);  // its output's memory is [B,S,H,Dh]
    if (sdpa) {
      // Saves query, key, value, its output ([B,S,H,Dh] in memory, so the transpose is free) and the
      // fp32 log-sum-exp; GQA without copies (enable_gqa).
      const T out = n.attention(query, k_embed, v, N * Hq * Dh, B * Hq * S * 4, attention_cost(S, Dh, B * Hq), Hq != Hkv, 0.0);
      OpCost exps = elementwise_cost(OpKind::Softmax, B * Hq * S * S / 2, 4);  // the kernel's exponentials (causal half)
      exps.on_chip = true;
      t.cost(exps);
      return out;
    }
    // repeat_kv copies K and V to every query head (expand + reshape; none when heads == kv_heads).
    const T key = rep > 1 ? t.op({&k_embed}, N * Hq * Dh, e, {}, false, 0, n.ew(2 * N * Hq * Dh * e)) : k_embed;
    const T value = rep > 1 ? t.op({&v}, N * Hq * Dh, e, {}, false, 0, n.ew(2 * N * Hq * Dh * e)) : v;
    T w;
    {
      const T qc = n.copy(query);  // q_embed keeps the [B,S,H,Dh] strides of the projection: a copy
      const T raw = n.bmm(qc, key, B * Hq * S * S, gemm_cost(S, S, Dh, B * Hq));
      w = n.scale(raw);
    }
    w = t.op({&w}, w.numel, w.elem, {}, false, 0, n.ew(2 * w.bytes()));  // + mask
    w = t.op({&w}, w.numel, 4, {}, true, 0, Net::act(OpKind::Softmax, w));  // softmax in fp32, saves its output
    w = n.cast(w, e);
    const T out = n.bmm(w, value, N * Hq * Dh, gemm_cost(S, Dh, S, B * Hq));
    return n.copy(out);  // .transpose(1, 2).contiguous()
  };
  const T attn = selective ? t.checkpoint(core, q_embed, {&k_embed, &v}, {}) : core(t, q_embed);
  const T h = n.add(x, n.leave(n.linear(attn, *p.o, nullptr, N, Hq * Dh, D)));
  const T normed2 = n.enter(rms_norm(n, h, *p.ln2, rows));
  const T gate = n.unary(n.linear(normed2, *p.gate, nullptr, N, D, F), true, false, OpKind::Activation);  // SiLU saves its input
  const T up = n.linear(normed2, *p.up, nullptr, N, D, F);
  return n.add(h, n.leave(n.linear(n.mul(gate, up), *p.down, nullptr, N, F, D)));
}

// ---- CNN (suites/models/models.cpp: Cnn, BasicBlock), fp32 ----------------------------------------
T conv(Net& n, const T& x, const T& w, int64_t cin, int64_t cout, int64_t k, int64_t hw_out) {
  const T xc = n.lower(x), wc = n.lower(w);
  OpCost cost = gemm_cost(n.r.batch * hw_out, cout, cin * k * k);
  cost.conv = true;
  const double out_bytes = static_cast<double>(n.r.batch * cout * hw_out * xc.elem);
  // The stride from the input's and output's sizes (square images, padding k / 2).
  const int64_t hw_in = x.numel / std::max<int64_t>(1, n.r.batch * cin);
  const int64_t stride = std::max<int64_t>(1, std::llround(std::sqrt(static_cast<double>(hw_in) / static_cast<double>(hw_out))));
  const ConvScratch::Shape* s = n.r.conv_workspace.nearest(cin, cout, k, stride);
  return n.t.op({&xc, &wc}, n.r.batch * cout * hw_out, xc.elem, {&xc, &wc}, false, 0, cost,
                s ? static_cast<int64_t>(s->forward * out_bytes) : 0, s ? static_cast<int64_t>(s->backward * out_bytes) : 0);
}
T batch_norm(Net& n, const T& x, const T& w, const T& b, int64_t c) {
  return n.t.op({&x, &w, &b}, x.numel, x.elem, {&x}, false, 2 * c * 4, Net::act(OpKind::Norm, x), 0,
                static_cast<int64_t>(n.r.batch_norm_backward_ratio * static_cast<double>(x.bytes())));
}

bool checkpointed(const std::string& policy, int64_t index) {
  if (policy == "full" || policy == "selective-op") return true;
  if (policy.rfind("every:", 0) == 0) return index % std::stoll(policy.substr(6)) == 0;
  return false;
}

// ReferenceModel::run_block: the block, checkpointed if the policy says so, inside the block wrapper
// when one is set.
T run_block(Tape& t, const Replay& r, size_t index, const Tape::BlockFn& fn, const T& x, const std::vector<const T*>& params) {
  Tape::BlockFn body = fn;
  if (checkpointed(r.checkpoint, static_cast<int64_t>(index))) {
    const bool op_level = r.checkpoint == "selective-op";
    body = [fn, params, op_level](Tape& tape, const T& in) { return tape.checkpoint(fn, in, {}, params, op_level); };
  }
  if (t.block_wrapper) return t.block_wrapper(index, body, x);
  return body(t, x);
}

// Under pp a rank keeps its stages' blocks, the embedding with the first layer, the final norm and
// the head with the last, a tied head on both (DecoderModel::used_by_layers); the others are emptied,
// their places kept.
void drop_other_stages(const Replay& r, ParamLayout& l) {
  const bool first = r.holds(0), last = r.holds(r.model.layers - 1);
  for (size_t i = 0; i < l.blocks.size(); ++i)
    if (!r.holds(static_cast<int64_t>(i))) std::fill(l.blocks[i].begin(), l.blocks[i].end(), 0);
  std::vector<bool> keep;
  if (r.model.family == "gpt") keep = {first || last, first, last, last};  // wte (the tied head), wpe, ln_f
  else keep = {first || (last && r.model.tied), last, last};                 // embed_tokens, norm, lm_head
  for (size_t i = 0; i < l.root.size(); ++i)
    if (!keep[i]) l.root[i] = 0;
}

}  // namespace

ParamLayout param_layout(const Replay& r) {
  const ModelShape& m = r.model;
  ParamLayout l;
  if (m.family == "gpt") {
    // One tp rank's shards (Gpt::set_tensor_parallel): the token table by vocabulary, q, k, v by heads,
    // fc by rows, proj and fc_proj by columns; positions, norms and the row-parallel biases whole.
    const int64_t D = m.width, tp = r.tp;
    l.root = {m.vocab / tp * D, m.seq_len * D, D, D};
    for (int64_t i = 0; i < m.layers; ++i)
      l.blocks.push_back({D, D, 3 * D * D / tp, 3 * D / tp, D * D / tp, D, D, D, 4 * D * D / tp, 4 * D / tp, 4 * D * D / tp, D});
  } else if (m.family == "llama") {
    // One tp rank's shards (Llama::set_tensor_parallel): q, gate, up, o, down and the vocabulary split;
    // k and v split when tp divides the key/value heads, else whole on every rank; norms whole.
    const int64_t tp = r.tp, D = m.width, q = m.heads * m.head_dim() / tp, F = m.ffn / tp, V = m.vocab / tp;
    const int64_t kv = m.kv_heads % tp == 0 ? m.kv_heads * m.head_dim() / tp : m.kv_heads * m.head_dim();
    l.root = {V * D, D};
    if (!m.tied) l.root.push_back(V * D);
    for (int64_t i = 0; i < m.layers; ++i) l.blocks.push_back({D, D * q, D * kv, D * kv, q * D, D, D * F, D * F, F * D});
  } else if (m.family == "mlp") {
    int64_t in = r.channels * r.height * r.width;
    for (int64_t h : m.hidden) {
      l.blocks.push_back({in * h, h});
      in = h;
    }
    l.root = {in * r.classes, r.classes};
  } else if (m.family == "cnn") {
    const int64_t w0 = m.width;
    l.root = {r.channels * w0 * 9, w0, w0};
    l.buffers.push_back(2 * w0 * 4 + 8);
    int64_t in = w0;
    for (size_t stage = 0; stage < m.hidden.size(); ++stage) {
      const int64_t out = w0 << stage;
      for (int64_t b = 0; b < m.hidden[stage]; ++b) {
        const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
        std::vector<int64_t> block = {in * out * 9, out, out, out * out * 9, out, out};
        l.buffers.push_back(2 * (2 * out * 4 + 8));
        if (stride != 1 || in != out) {
          block.insert(block.end(), {in * out, out, out});
          l.buffers.push_back(2 * out * 4 + 8);
        }
        l.blocks.push_back(block);
        in = out;
      }
    }
    l.root.insert(l.root.end(), {in * r.classes, r.classes});
  } else {
    throw UsageError(replay_unsupported(m));
  }
  if (!r.held.empty()) drop_other_stages(r, l);
  return l;
}

OpCost cp_attention_layer_cost(const Replay& r, int64_t batch) {
  const ModelShape& m = r.model;
  const std::vector<double> ranks = context_parallel_pairs(m.seq_len, r.cp, r.cp_balance);
  const double pairs = *std::max_element(ranks.begin(), ranks.end());
  return attention_cost(static_cast<int64_t>(std::llround(std::sqrt(2 * pairs))), m.head_dim(), batch * (m.heads / r.tp));
}

namespace {

// The parameters as the tape's tensors: the root's, then each block's, in the layout's order.
using Refs = std::vector<const T*>;
struct ParamRefs {
  Refs root;
  std::vector<Refs> blocks;
};

ParamRefs param_refs(const Replay& r, const std::vector<T>& params) {
  const ParamLayout layout = param_layout(r);
  ParamRefs p;
  size_t at = 0;
  for (size_t i = 0; i < layout.root.size(); ++i) p.root.push_back(&params[at++]);
  for (const auto& b : layout.blocks) {
    p.blocks.emplace_back();
    for (size_t i = 0; i < b.size(); ++i) p.blocks.back().push_back(&params[at++]);
  }
  return p;
}

// GPT: token and position embeddings (from the first stage), the blocks this stage holds, the final
// norm, the head (tied to the embedding) and the loss (from the last).
T gpt_forward_loss(Tape& t, const Replay& r, Net& n, const Refs& root, const std::vector<Refs>& blocks, const T& input) {
  const ModelShape& m = r.model;
  const bool selective = r.checkpoint == "selective";
  const int64_t B = r.batch;
  const int64_t first = r.first_layer, last = r.last_layer < 0 ? m.layers : r.last_layer;
  const int64_t S = r.local_seq(), D = m.width, N = B * S;
  T h = input;
  if (first == 0) {
    // Under tp (Gpt::embed): the vocabulary-parallel lookup (as Llama's below), then the positions of
    // this rank's tokens.
    const int64_t s = r.tp > 1 && r.sequence_parallel ? S / r.tp : S;
    const T pos = t.data(s, 8);  // arange
    const T tok = r.tp > 1 ? n.vocab_embedding(*root[0], N) : t.op({root[0]}, N * D, r.num.param, {}, false, 0, n.ew(N * D * r.num.param));
    const T pe = t.op({root[1]}, s * D, r.num.param, {}, false, 0, n.ew(s * D * r.num.param));
    h = n.boundary(n.add(tok, pe));
  }
  for (auto i = static_cast<size_t>(first); i < static_cast<size_t>(last); ++i) {
    const auto& b = blocks[i];
    const GptBlockParams p{b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11]};
    auto fn = [n, p, selective](Tape&, const T& x) mutable { return gpt_block(n, x, p, selective); };
    h = run_block(t, r, i, fn, h, b);
    h = n.boundary(h);
  }
  if (last < m.layers) return h;
  T logits = n.boundary(n.linear(n.enter(n.layer_norm(h, *root[2], *root[3], h.numel / D)), *root[0], nullptr, N, D, m.vocab / r.tp));
  h = T();
  return n.loss(logits, N, m.vocab);
}

// Llama: the embedding, the RoPE tables (and the causal mask of eager attention), the blocks this
// stage holds, the final RMSNorm, the head and the loss.
T llama_forward_loss(Tape& t, const Replay& r, Net& n, const Refs& root, const std::vector<Refs>& blocks, const T& input) {
  const ModelShape& m = r.model;
  const bool selective = r.checkpoint == "selective";
  const int64_t B = r.batch;
  const int64_t first = r.first_layer, last = r.last_layer < 0 ? m.layers : r.last_layer;
  const int64_t S = r.local_seq(), D = m.width, N = B * S;
  T h = input;
  if (first == 0 && r.tp > 1) {
    h = n.boundary(n.vocab_embedding(*root[0], N));
  } else if (first == 0) {
    h = n.boundary(t.op({root[0]}, N * D, r.num.param, {}, false, 0, n.ew(N * D * r.num.param)));
  }
  // Under cp the whole sequence's tables are made and this rank's rows taken (Llama::forward_layers).
  const T cos_all = r.cp > 1 ? t.data(m.seq_len * m.head_dim(), h.elem) : T(), sin_all = r.cp > 1 ? t.data(m.seq_len * m.head_dim(), h.elem) : T();
  const T cos = t.data(S * m.head_dim(), h.elem), sin = t.data(S * m.head_dim(), h.elem);
  const T mask = m.attention == "sdpa" || r.cp > 1 ? T() : t.data(S * S, h.elem);
  for (auto i = static_cast<size_t>(first); i < static_cast<size_t>(last); ++i) {
    const auto& b = blocks[i];
    const LlamaBlockParams p{b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8]};
    auto fn = [n, p, selective](Tape&, const T& x) mutable { return llama_block(n, x, p, selective); };
    h = run_block(t, r, i, fn, h, b);
    h = n.boundary(h);
  }
  if (last < m.layers) return h;
  T logits;
  {
    const T out = n.enter(rms_norm(n, h, *root[1], h.numel / D));
    h = T();
    logits = n.boundary(n.linear(out, m.tied ? *root[0] : *root[2], nullptr, N, D, m.vocab / r.tp));
  }
  return n.loss(logits, N, m.vocab);
}

// MLP: a linear and an activation per block, then the classifier and the loss.
T mlp_forward_loss(Tape& t, const Replay& r, Net& n, const Refs& root, const std::vector<Refs>& blocks, const T& input) {
  const ModelShape& m = r.model;
  const int64_t B = r.batch;
  T h = input;
  int64_t in = r.channels * r.height * r.width;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t out = m.hidden[i];
    const auto& b = blocks[i];
    auto fn = [n, b, in, out, B](Tape&, const T& x) mutable { return n.unary(n.linear(x, *b[0], b[1], B, in, out), false, true); };
    h = run_block(t, r, i, fn, h, b);
    h = n.boundary(h);
    in = out;
  }
  T logits = n.boundary(n.linear(h, *root[0], root[1], B, in, r.classes));
  h = T();
  return n.loss(logits, B, r.classes);
}

// CNN: the stem, the residual blocks per stage (the first of each later stage strided, with a 1x1
// shortcut), the pooled classifier and the loss.
T cnn_forward_loss(Tape& t, const Replay& r, Net& n, const Refs& root, const std::vector<Refs>& blocks, const T& input) {
  const ModelShape& m = r.model;
  const int64_t B = r.batch;
  int64_t hw = r.height * r.width;
  const int64_t w0 = m.width;
  T h;
  {
    const T c = conv(n, input, *root[0], r.channels, w0, 3, hw);
    h = n.boundary(n.unary(batch_norm(n, c, *root[1], *root[2], w0), false, true));
  }
  int64_t in = w0, hh = r.height, ww = r.width;
  size_t bi = 0;
  for (size_t stage = 0; stage < m.hidden.size(); ++stage) {
    const int64_t out = w0 << stage;
    for (int64_t k = 0; k < m.hidden[stage]; ++k, ++bi) {
      const int64_t stride = (stage > 0 && k == 0) ? 2 : 1;
      const int64_t h2 = (hh + 2 - 3) / stride + 1, w2 = (ww + 2 - 3) / stride + 1;
      const auto& b = blocks[bi];
      const bool shortcut = b.size() > 6;
      auto fn = [n, b, in, out, hw_out = h2 * w2, shortcut](Tape&, const T& x) mutable {
        T y = n.unary(batch_norm(n, conv(n, x, *b[0], in, out, 3, hw_out), *b[1], *b[2], out), false, true);
        y = batch_norm(n, conv(n, y, *b[3], out, out, 3, hw_out), *b[4], *b[5], out);
        const T s = shortcut ? batch_norm(n, conv(n, x, *b[6], in, out, 1, hw_out), *b[7], *b[8], out) : x;
        return n.unary(n.add(y, s), false, true);
      };
      h = run_block(t, r, bi, fn, h, b);
      h = n.boundary(h);
      in = out;
      hh = h2;
      ww = w2;
    }
  }
  T logits;
  {
    const T pooled = t.op({&h}, B * in, h.elem, {}, false, 0, n.ew(h.bytes()));  // mean over H, W
    h = T();
    logits = n.boundary(n.linear(pooled, *root[root.size() - 2], root.back(), B, in, r.classes));
  }
  return n.loss(logits, B, r.classes);
}

}  // namespace

T forward_loss(Tape& t, const Replay& r, const std::vector<T>& params, const T& input, const T&) {
  Net n{t, r, r.num};
  const ParamRefs w = param_refs(r, params);
  if (r.model.family == "gpt") return gpt_forward_loss(t, r, n, w.root, w.blocks, input);
  if (r.model.family == "llama") return llama_forward_loss(t, r, n, w.root, w.blocks, input);
  if (r.model.family == "mlp") return mlp_forward_loss(t, r, n, w.root, w.blocks, input);
  return cnn_forward_loss(t, r, n, w.root, w.blocks, input);
}

}  // namespace trainscope::plan
