// Context parallelism (suites/parallel/context_parallel.hpp): the head-tail shards, the ranks' attention
// (ring and all-gather, 2 and 4 ranks as threads over Gloo) bit for bit against the one-process emulation
// forward and backward and against torch's own ring-attention templates, the emulation against full
// attention within the merge's bound, training with cp alone, under FSDP and with tensor parallelism
// against one process on the whole sequence, and the long-context suite.
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <thread>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "cli_support.hpp"
#include "core/layout.hpp"
#include "suites/parallel/comm.hpp"
#include "suites/parallel/context_parallel.hpp"
#include "test_support.hpp"

using namespace trainscope;
using namespace trainscope::test;
namespace cpar = trainscope::suites::context_parallel;

namespace {

std::vector<int64_t> longs(const torch::Tensor& t) { return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel()); }

// Inputs of one attention: q [B, H, S, Dh], k and v [B, Hkv, S, Dh] (grouped-query), the output's gradient.
struct Inputs {
  torch::Tensor q, k, v, dout;
};
Inputs make_inputs(int64_t S, at::ScalarType dtype, uint64_t seed) {
  torch::manual_seed(seed);
  const int64_t B = 2, H = 4, Hkv = 2, Dh = 8;
  return {torch::randn({B, H, S, Dh}).to(dtype), torch::randn({B, Hkv, S, Dh}).to(dtype), torch::randn({B, Hkv, S, Dh}).to(dtype),
          torch::randn({B, H, S, Dh}).to(dtype)};
}

struct Grads {
  torch::Tensor out, dq, dk, dv;
};

// What `degree` ranks (threads, one Gloo communicator each) compute: rank r's shard of each result.
std::vector<Grads> run_ranks(const Inputs& in, int64_t degree, const std::string& method, bool balance, double scale) {
  // c10d's process-global flight recorder registers each group's status without its lock
  // (FlightRecorder::recordWithResetEnabled), which crashes when ranks are threads enqueueing at once:
  // off, before its first use in this process.
  setenv("TORCH_FR_BUFFER_SIZE", "0", 1);
  c10d::TCPStoreOptions opts;
  opts.port = 0;
  opts.isServer = true;
  opts.waitWorkers = false;
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  const int port = server->getPort();
  std::vector<Grads> results(static_cast<size_t>(degree));
  const std::string prefix = "cp-" + method + (balance ? "-b" : "-c") + std::to_string(degree);
  auto rank = [&](int r) {
    suites::Communicator comm(suites::Rendezvous{"127.0.0.1", port, prefix, r, static_cast<int>(degree)}, "gloo", torch::Device("cpu"), 60);
    suites::ContextParallel cp;
    cp.group = &comm;
    cp.rank = r;
    cp.degree = degree;
    cp.method = method;
    cp.balance = balance;
    const torch::Tensor q = cpar::shard(in.q, 2, cp).requires_grad_(), k = cpar::shard(in.k, 2, cp).requires_grad_(),
                        v = cpar::shard(in.v, 2, cp).requires_grad_();
    const torch::Tensor out = cpar::attention(q, k, v, scale, cp);
    out.backward(cpar::shard(in.dout, 2, cp));
    results[static_cast<size_t>(r)] = {out.detach(), q.grad(), k.grad(), v.grad()};
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < degree; ++r) threads.emplace_back(rank, r);
  for (auto& t : threads) t.join();
  return results;
}

Grads run_emulation(const Inputs& in, int64_t degree, const std::string& method, bool balance, double scale) {
  const torch::Tensor q = in.q.clone().requires_grad_(), k = in.k.clone().requires_grad_(), v = in.v.clone().requires_grad_();
  const torch::Tensor out = cpar::emulate(q, k, v, scale, degree, method, balance);
  out.backward(in.dout);
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

// One-process causal attention in fp64 (grouped-query heads expanded as HF's repeat_kv): the reference.
Grads run_full_fp64(const Inputs& in, double scale) {
  const int64_t n_rep = in.q.size(1) / in.k.size(1);
  const torch::Tensor q = in.q.to(torch::kDouble).requires_grad_(), k = in.k.to(torch::kDouble).requires_grad_(),
                      v = in.v.to(torch::kDouble).requires_grad_();
  const torch::Tensor out = at::scaled_dot_product_attention(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), {}, 0.0,
                                                             /*is_causal=*/true, scale);
  out.backward(in.dout.to(torch::kDouble));
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

double max_abs(const torch::Tensor& t) { return t.abs().max().item<double>(); }

}  // namespace

// torch's _HeadTailLoadBalancer returns [0, 1, 6, 7 | 2, 3, 4, 5] for S = 8 on 2 ranks (the notes measured
// it); the contiguous layout is [0..3 | 4..7]. Balanced, every rank's causal pairs are equal (4 ranks);
// contiguous, the last rank's outnumber the first's.
TEST(ContextParallel, ShardsAreHeadTailAndBalanceTheCausalWork) {
  EXPECT_EQ(longs(cpar::positions(8, 0, 2, true)), (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(longs(cpar::positions(8, 1, 2, true)), (std::vector<int64_t>{2, 3, 4, 5}));
  EXPECT_EQ(longs(cpar::positions(8, 1, 2, false)), (std::vector<int64_t>{4, 5, 6, 7}));
  EXPECT_EQ(longs(cpar::positions(16, 3, 4, true)), (std::vector<int64_t>{6, 7, 8, 9}));
  const std::vector<double> even = context_parallel_pairs(64, 4, true), skewed = context_parallel_pairs(64, 4, false);
  // The formula counts what the shards hold: each position p sees p + 1 keys.
  for (int64_t r = 0; r < 4; ++r) {
    EXPECT_EQ(even[r], (cpar::positions(64, r, 4, true) + 1).sum().item<double>()) << r;
    EXPECT_EQ(skewed[r], (cpar::positions(64, r, 4, false) + 1).sum().item<double>()) << r;
  }
  for (double p : even) EXPECT_EQ(p, even[0]);
  // Contiguous rank r of W holds c tokens after r c others: c (r c) + c (c + 1) / 2 pairs (c = 16).
  EXPECT_EQ(skewed[0], 16.0 * 17 / 2);
  EXPECT_EQ(skewed[3], 16.0 * 48 + 16.0 * 17 / 2);
  double total_even = 0, total_skewed = 0;
  for (size_t r = 0; r < 4; ++r) total_even += even[r], total_skewed += skewed[r];
  EXPECT_EQ(total_even, 64.0 * 65 / 2);  // every causal pair once
  EXPECT_EQ(total_skewed, 64.0 * 65 / 2);
  EXPECT_THAT_ERROR(cpar::positions(12, 0, 4, true), "2 x cp equal chunks");
}

// The ranks run the emulation's blocks, merges and sums, so every result is the same bits: the ring and
// the all-gather (the same blocks, fetched otherwise), balanced and contiguous, on 2 and 4 ranks, in fp32
// and bf16, with grouped-query heads.
TEST(ContextParallel, RanksEqualTheEmulationBitForBit) {
  const double scale = 1.0 / std::sqrt(8.0);
  for (const auto dtype : {torch::kFloat, torch::kBFloat16})
    for (const int64_t degree : {2, 4})
      for (const std::string method : {"ring", "allgather"})
        for (const bool balance : {true, false}) {
          const std::string what = std::string(c10::toString(dtype)) + " cp" + std::to_string(degree) + " " + method + (balance ? " balanced" : " contiguous");
          const Inputs in = make_inputs(32, dtype, 7);
          const Grads emu = run_emulation(in, degree, method, balance, scale);
          const std::vector<Grads> ranks = run_ranks(in, degree, method, balance, scale);
          for (int64_t r = 0; r < degree; ++r) {
            suites::ContextParallel cp;
            cp.rank = r, cp.degree = degree, cp.balance = balance;
            const Grads& got = ranks[static_cast<size_t>(r)];
            EXPECT_TRUE(torch::equal(got.out, cpar::shard(emu.out, 2, cp))) << what << " rank " << r << " out";
            EXPECT_TRUE(torch::equal(got.dq, cpar::shard(emu.dq, 2, cp))) << what << " rank " << r << " dq";
            EXPECT_TRUE(torch::equal(got.dk, cpar::shard(emu.dk, 2, cp))) << what << " rank " << r << " dk";
            EXPECT_TRUE(torch::equal(got.dv, cpar::shard(emu.dv, 2, cp))) << what << " rank " << r << " dv";
          }
        }
}

// The emulation against one-process attention in fp64, fp32 inputs. Bound (u = 2^-24, S keys, W ranks):
// each block kernel's output is a weighted mean of value rows, its error at most (2 S + 8) u max|v| (the
// sums of S exponentials and products, the exponentials' and the division's roundings); each of the
// W - 1 merges adds at most 7 u max|v| (a difference of two such means, bounded by 2 max|v|, scaled by
// a sigmoid in [0, 1]: three roundings and the sigmoid's two) plus what an lse error e does to the
// weights, 2 e max|v|, with e at most 3 u |lse| per merge. The gradients' terms are bounded the same way
// by their magnitudes: dq by scale (2 max|dout| Dh max|v|) Dh max|k| per key, summed over S keys; dk by
// the same with max|q| over S queries; dv by max|dout| over S queries; with the same per-term error.
TEST(ContextParallel, EmulationIsFullAttentionWithinTheMergeBound) {
  const double u = std::ldexp(1.0, -24), scale = 1.0 / std::sqrt(8.0);
  const int64_t S = 64, Dh = 8;
  const Inputs in = make_inputs(S, torch::kFloat, 11);
  const Grads ref = run_full_fp64(in, scale);
  const double mv = max_abs(in.v), mk = max_abs(in.k), mq = max_abs(in.q), mo = max_abs(in.dout);
  for (const int64_t W : {2, 4})
    for (const std::string method : {"ring"})  // the all-gather computes the same blocks (test above)
      for (const bool balance : {true, false}) {
        const Grads emu = run_emulation(in, W, method, balance, scale);
        const double lse = std::log(static_cast<double>(S)) + scale * Dh * mq * mk;  // |lse| <= log S + max score
        const double per_term = ((2.0 * S + 8) + (W - 1) * (7 + 6 * W * lse)) * u;
        const std::string what = method + " cp" + std::to_string(W) + (balance ? " balanced" : " contiguous");
        EXPECT_LE(max_abs(emu.out.to(torch::kDouble) - ref.out), per_term * mv) << what;
        const double dq_terms = S * scale * 2 * mo * Dh * mv * Dh * mk;
        EXPECT_LE(max_abs(emu.dq.to(torch::kDouble) - ref.dq), per_term * dq_terms) << what;
        EXPECT_LE(max_abs(emu.dk.to(torch::kDouble) - ref.dk), per_term * S * scale * 2 * mo * Dh * mv * Dh * mq) << what;
        EXPECT_LE(max_abs(emu.dv.to(torch::kDouble) - ref.dv), per_term * S * mo) << what;
        // And a wrong block choice is far outside it: the emulation is not trivially close.
        EXPECT_GT(max_abs(ref.out), 100 * per_term * mv) << what;
      }
}

namespace {

std::vector<torch::Tensor> load_params(const std::string& path) {
  std::vector<torch::Tensor> v;
  torch::load(v, path);
  return v;
}

const std::string kCpBase = kExactBase + R"(batch_size = 4
data = "synthetic-tokens"
rng_every = 1
attention = "sdpa"
[models.cp-llama]
family = "llama"
layers = 2
d_model = 32
heads = 4
kv_heads = 2
ffn = 64
seq_len = 32
vocab = 256
tied = false
[models.cp-gpt]
family = "gpt"
layers = 2
d_model = 32
heads = 4
seq_len = 32
vocab = 256
)";

// A suite of the cp tests: the base above and `cells`.
std::string cp_suite(const std::string& name, const std::string& cells) {
  return "name = \"" + name + "\"\n[base]\nmodel = \"cp-llama\"\n" + kCpBase + cells;
}

// Every rank of a cell ends with the same full parameters, within atol of `expected`.
void expect_cell_matches(const std::string& out, const std::string& cell, int ranks, const std::vector<torch::Tensor>& expected, double atol) {
  for (int r = 0; r < ranks; ++r) {
    const auto got = load_params(out + "/cells/" + cell + ".rank" + std::to_string(r) + ".params.pt");
    ASSERT_EQ(got.size(), expected.size()) << cell << " rank " << r;
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_TRUE(torch::allclose(got[i], expected[i], /*rtol=*/0, atol))
          << cell << " rank " << r << " parameter " << i << ": max |diff| " << (got[i] - expected[i]).abs().max().item<double>();
  }
}

}  // namespace

// cp trains Llama (grouped-query) and GPT like one process on the whole sequence: each method, balanced
// and contiguous, on 2 and 4 ranks, under FSDP (dp_shard 2 x cp 2: FSDP over both, as torchtitan's
// dp_shard_cp) and with tensor and sequence parallelism (cp 2 x tp 2). fp64, so what differs is the order
// of sums: the attention's merges and the mean of the ranks' token means for the global mean, each a
// reassociation of fp64 terms of the parameters' size (atol 1e-12 after 3 steps, as the other layouts').
// `parallel = zero3` over the cp ranks alone ("cp2-zero3") shards the model state over them.
TEST(ContextParallel, TrainsLikeOneProcessOnTheWholeSequence) {
  const SuiteRun run = run_suite_text("context-parallel", cp_suite("context-parallel", R"(
[[cells]]
name = "single"
[[cells]]
name = "ring"
cp = 2
cp_method = "ring"
[[cells]]
name = "ring-contiguous"
cp = 2
cp_method = "ring"
cp_balance = false
[[cells]]
name = "allgather"
cp = 2
[[cells]]
name = "allgather-contiguous"
cp = 2
cp_balance = false
[[cells]]
name = "ring4"
cp = 4
cp_method = "ring"
[[cells]]
name = "fsdp"
dp_shard = 2
cp = 2
batch_size = 2
[[cells]]
name = "zero3-over-cp"
cp = 2
parallel = "zero3"
world_size = 2
[[cells]]
name = "tp"
tp = 2
cp = 2
cp_method = "ring"
sequence_parallel = true
[[cells]]
name = "gpt-single"
model = "cp-gpt"
[[cells]]
name = "gpt-ring"
model = "cp-gpt"
cp = 2
cp_method = "ring"
)"), "--nproc 4");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  std::vector<torch::Tensor> one = load_params(run.out + "/cells/single.params.pt");
  ASSERT_FALSE(one.empty());
  for (const std::string cell : {"ring", "ring-contiguous", "allgather", "allgather-contiguous", "zero3-over-cp"})
    expect_cell_matches(run.out, cell, 2, one, 1e-12);
  for (const std::string cell : {"ring4", "fsdp", "tp"}) expect_cell_matches(run.out, cell, 4, one, 1e-12);
  expect_cell_matches(run.out, "gpt-ring", 2, load_params(run.out + "/cells/gpt-single.params.pt"), 1e-12);

  const json ring = cell_named(run.report, "ring");
  EXPECT_EQ(ring["layout"]["name"], "cp2");
  EXPECT_EQ(cell_named(run.report, "fsdp")["layout"]["name"], "dp_shard2-cp2");
  EXPECT_EQ(cell_named(run.report, "zero3-over-cp")["layout"]["name"], "cp2-zero3");  // FSDP over the cp ranks
  EXPECT_LT(cell_named(run.report, "zero3-over-cp")["metrics"]["memory"]["model_state_total_bytes"].get<double>(),
            0.6 * ring["metrics"]["memory"]["model_state_total_bytes"].get<double>());
  const json cpj = ring["metrics"]["timing"]["context_parallel"];
  EXPECT_EQ(cpj["method"], "ring");
  EXPECT_EQ(cpj["imbalance"]["balanced"].get<double>(), 1.0);
  // Contiguous on 2 ranks: rank 1 has 16 x 16 + 136 pairs, rank 0 136; the largest over the mean.
  EXPECT_DOUBLE_EQ(cpj["imbalance"]["contiguous"].get<double>(), 392.0 * 2 / (392 + 136));
  // Per layer on W ranks: the keys and values go W - 1 steps around forward and again backward, their
  // gradients' sums (fp64 here) W steps, the last to their owner: 4 transfers of this rank's keys and
  // values for W = 2, 2 layers.
  const int64_t kv = 2 * (4 * 2 * 16 * 8) * 8;  // k and v of this rank: batch 4, 2 heads, 16 tokens, Dh 8, fp64
  EXPECT_EQ(cpj["bytes_sent_per_step"].get<int64_t>(), 2 * 4 * kv) << cpj.dump();
  // The all-gather sends its keys and values to the W - 1 others forward and again backward (a ring
  // all-gather's share), and the gradients' sums around the ring as above: the same 4 transfers.
  const json gather = cell_named(run.report, "allgather")["metrics"]["timing"]["context_parallel"];
  EXPECT_EQ(gather["bytes_sent_per_step"].get<int64_t>(), 2 * 4 * kv) << gather.dump();
  EXPECT_GE(cpj["hidden_fraction"].get<double>(), 0.0);
  EXPECT_LE(cpj["hidden_fraction"].get<double>(), 1.0);
  EXPECT_GT(cpj["attention_s"].get<double>(), 0.0);
  // The cp ranks of one data-parallel rank share its samples, each its own tokens: no RNG finding.
  EXPECT_EQ(ring["metrics"]["rng"].value("violations", -1), 0) << ring["metrics"]["rng"].dump();
}

// A layout cp cannot take is one line before any rank starts.
TEST(ContextParallel, BadSettingsAreOneLineErrors) {
  const auto fails = [](const std::string& extra, const std::string& part) {
    const SuiteRun run = run_suite_text("cp-bad", cp_suite("cp-bad", "\n[[cells]]\nname = \"bad\"\n" + extra));
    EXPECT_NE(run.result.code, 0) << extra;
    EXPECT_NE(run.result.out.find(part), std::string::npos) << extra << ": " << run.result.out;
  };
  fails("cp = 3\n", "2 x cp equal chunks");
  fails("cp = 2\ncp_method = \"ulysses\"\n", "ulysses");
  fails("cp = 2\npp = 2\n", "cp with pp");
  fails("cp = 2\nmodel = \"cp-gpt\"\ndropout = 0.1\n", "set dropout = 0");
  fails("cp = 2\ndevice = \"cuda\"\n", "CUDA kernels are not wired yet");
}

// The long-context suite: one rank meets the budget at 1K tokens and ends oom at 2K and 4K; cp 2 trains
// 2K and cp 4 trains 4K, each rank under the budget. The ring and the all-gather compute the same blocks:
// the same losses to the bit. Against one rank without the budget the losses differ by the attention's
// rounding: each attention output is within (2S + 8) u of max|v| of the exact one on either side
// (EmulationIsFullAttentionWithinTheMergeBound), 4.9e-4 at S = 4096; the loss of this freshly
// initialised model (about ln 256) moves by less than that fraction of itself (assumed, not derived: its
// sensitivity to its inputs is below 1). The exactness of cp is the tests above; this is the suite's sanity.
TEST(ContextParallel, LongContextSuiteFitsWhereOneRankCannot) {
  const std::string out = tmp("long-context");
  sh("rm -rf " + out);
  const auto r = ts("run --suite long-context --out " + out + " --nproc 4");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ifstream in(out + "/report.json");
  const json report = json::parse(in);
  EXPECT_EQ(cell_named(report, "1k/cp1")["status"], "ok");
  EXPECT_EQ(cell_named(report, "2k/cp1")["status"], "oom");
  EXPECT_EQ(cell_named(report, "4k/cp1")["status"], "oom");
  for (const std::string cell : {"2k/cp2-ring", "4k/cp4-ring", "4k/cp4-allgather", "4k/cp4-ring-contiguous"}) {
    const json c = cell_named(report, cell);
    EXPECT_EQ(c["status"], "ok") << cell;
    EXPECT_LE(c["metrics"]["memory"]["peak_bytes"].get<double>(), 18.0 * 1024 * 1024) << cell;
  }
  const auto losses = [&](const std::string& cell) { return cell_named(report, cell)["metrics"]["quality"]["step_losses"]; };
  EXPECT_EQ(losses("4k/cp4-ring"), losses("4k/cp4-allgather"));
  const json one = losses("4k/cp1-unbounded"), ring = losses("4k/cp4-ring");
  ASSERT_EQ(one.size(), ring.size());
  ASSERT_FALSE(one.empty());
  for (size_t i = 0; i < one.size(); ++i)
    EXPECT_NEAR(ring[i].get<double>(), one[i].get<double>(), (2.0 * 4096 + 8) * std::ldexp(1.0, -24) * one[i].get<double>()) << "step " << i;
  const json imbalance = cell_named(report, "4k/cp4-ring-contiguous")["metrics"]["timing"]["context_parallel"]["imbalance"];
  EXPECT_EQ(imbalance["balanced"].get<double>(), 1.0);
  // Contiguous on 4 ranks of 1024 tokens: rank 3 has 1024 x 3072 + 1024 x 1025 / 2 pairs of the 4096 x 4097 / 2.
  EXPECT_DOUBLE_EQ(imbalance["contiguous"].get<double>(), (1024.0 * 3072 + 1024.0 * 1025 / 2) * 4 / (4096.0 * 4097 / 2));
}

namespace {

void write_dict(const std::string& path, const std::map<std::string, torch::Tensor>& items) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::TensorType::get());
  for (const auto& [k, t] : items) d.insert(k, t);
  const std::vector<char> bytes = torch::pickle_save(c10::IValue(d));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

c10::impl::GenericDict read_dict(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

}  // namespace

// Against torch's own templates (tests/parity/cp_ref.py: _templated_ring_attention and its backward on 2
// Gloo ranks with the CPU flash kernel, both of their rotations): the same blocks, the same merges in
// fp32, dq summed block by block, each rank's dk and dv the sum of two partials (a two-term sum: order
// free), so the ranks' out, dq, dk and dv equal torch's bit for bit, head-tail and contiguous. With
// equal heads: the templates take no grouped-query keys (trainscope's fold per block and torch's
// repeat_kv backward after the sum would order the n_rep sums differently).
TEST(ContextParallel, RanksEqualTorchsRingAttentionTemplatesBitForBit) {
  const std::string dir = tmp("cp-torch");
  sh("rm -rf " + dir + " && mkdir -p " + dir);
  torch::manual_seed(3);
  Inputs in{torch::randn({2, 4, 32, 8}), torch::randn({2, 4, 32, 8}), torch::randn({2, 4, 32, 8}), torch::randn({2, 4, 32, 8})};
  write_dict(dir + "/in.pt", {{"q", in.q}, {"k", in.k}, {"v", in.v}, {"dout", in.dout}});
  const std::string py = std::string(kTorchVenv).empty() ? "python3" : std::string(kTorchVenv) + "/bin/python";
  const auto r = sh(py + " " + source_dir() + "/tests/parity/cp_ref.py " + dir + "/in.pt " + dir + "/torch 2>&1");
  ASSERT_EQ(r.code, 0) << r.out;
  const double scale = 1.0 / std::sqrt(8.0);
  for (const bool balance : {true, false}) {
    const std::vector<Grads> ours = run_ranks(in, 2, "ring", balance, scale);
    for (const std::string rotation : {"allgather", "alltoall"})
      for (int rank = 0; rank < 2; ++rank) {
        const std::string what = std::string(balance ? "balanced" : "contiguous") + "-" + rotation;
        const auto theirs = read_dict(dir + "/torch." + what + ".rank" + std::to_string(rank) + ".pt");
        const Grads& g = ours[static_cast<size_t>(rank)];
        EXPECT_TRUE(torch::equal(g.out, theirs.at("out").toTensor())) << what << " rank " << rank << " out";
        EXPECT_TRUE(torch::equal(g.dq, theirs.at("dq").toTensor())) << what << " rank " << rank << " dq";
        EXPECT_TRUE(torch::equal(g.dk, theirs.at("dk").toTensor())) << what << " rank " << rank << " dk";
        EXPECT_TRUE(torch::equal(g.dv, theirs.at("dv").toTensor())) << what << " rank " << rank << " dv";
      }
  }
}
