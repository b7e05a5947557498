// Reference models (shapes, parameter counts, FLOPs by hand), data sources and the training loop.
#include <zlib.h>

#include <gtest/gtest.h>

#include "test_paths.hpp"
#include "test_support.hpp"

#include <sys/wait.h>

#include <filesystem>
#include <fstream>

#include "core/compat.hpp"
#include "core/errors.hpp"
#include "core/model_shape.hpp"
#include "probes/step/memory.hpp"
#include "suites/models/data.hpp"
#include "suites/train.hpp"

using namespace trainscope;
using namespace trainscope::suites;

namespace {

std::shared_ptr<ReferenceModel> build(const std::string& preset, const DataShape& shape) {
  torch::manual_seed(0);
  return make_model(model_preset(preset), shape);
}

DataShape tokens_of(const std::string& preset) {
  DataShape s;
  s.vocab = model_preset(preset).vocab;
  s.seq_len = model_preset(preset).seq_len;
  return s;
}

std::string tmp_dir() {
  const std::string dir = test::kScratchDir;
  std::system(("mkdir -p " + dir).c_str());
  return dir;
}

}  // namespace

TEST(Models, MlpShapeParametersAndFlopsByHand) {
  auto m = build("mlp-tiny", DataShape{});
  EXPECT_EQ(m->forward(torch::zeros({5, 1, 28, 28})).sizes(), (std::vector<int64_t>{5, 10}));
  const int64_t by_hand = (784 * 64 + 64) + (64 * 10 + 10);
  EXPECT_EQ(count_parameters(*m), by_hand);
  EXPECT_EQ(m->analytic_parameters(), by_hand);
  EXPECT_DOUBLE_EQ(m->training_flops_per_sample(), 6.0 * (784 * 64 + 64 * 10));
}

TEST(Models, CnnShapeParametersAndFlopsByHand) {
  auto m = build("cnn-tiny", DataShape{});
  EXPECT_EQ(m->forward(torch::zeros({3, 1, 28, 28})).sizes(), (std::vector<int64_t>{3, 10}));
  // stem conv 1->8 + BN; block 8->8 (two 3x3 convs + BNs); block 8->16 stride 2 (+ 1x1 shortcut + BN); fc.
  const int64_t by_hand = (1 * 8 * 9 + 16) + (2 * (8 * 8 * 9 + 16)) +
                          (8 * 16 * 9 + 32 + 16 * 16 * 9 + 32 + 8 * 16 + 32) + (16 * 10 + 10);
  EXPECT_EQ(by_hand, 5122);
  EXPECT_EQ(count_parameters(*m), by_hand);
  EXPECT_EQ(m->analytic_parameters(), by_hand);
  // MACs: stem at 28x28, two convs at 28x28, then at 14x14 two 3x3 convs and the 1x1 shortcut, fc.
  const double macs = 1.0 * 8 * 9 * 784 + 2.0 * 8 * 8 * 9 * 784 + 8.0 * 16 * 9 * 196 + 16.0 * 16 * 9 * 196 +
                      8.0 * 16 * 196 + 16.0 * 10;
  EXPECT_DOUBLE_EQ(m->training_flops_per_sample(), 6.0 * macs);
}

TEST(Models, GptShapeParametersAndFlopsByHand) {
  auto m = build("gpt-tiny", tokens_of("gpt-tiny"));
  auto logits = m->forward(torch::zeros({2, 64}, torch::kLong));
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 64, 256}));
  const int64_t V = 256, D = 64, S = 64, L = 2;
  const int64_t block = 2 * D + (D * 3 * D + 3 * D) + (D * D + D) + 2 * D + (D * 4 * D + 4 * D) + (4 * D * D + D);
  const int64_t by_hand = V * D + S * D + L * block + 2 * D;  // head tied to the token embedding
  EXPECT_EQ(by_hand, 120576);
  EXPECT_EQ(count_parameters(*m), by_hand);
  EXPECT_EQ(m->analytic_parameters(), by_hand);
  const double n = static_cast<double>(by_hand - S * D);
  // Full attention (torchtitan) first, the causal half (Megatron-Bridge) beside it.
  EXPECT_DOUBLE_EQ(m->training_flops_per_sample(), (6.0 * n + 12.0 * L * D * S) * S);
  EXPECT_DOUBLE_EQ(m->causal_flops_per_sample(), (6.0 * n + 6.0 * L * D * S) * S);
  EXPECT_EQ(m->tokens_per_sample(), 64);
}

// The published Llama 3 shapes, counted from their dimensions without allocating anything: the counts
// Meta's model cards and HF's configs give (Llama 3.2 1B "1.23B", tied; Llama 3.1 8B, 70B and 405B, untied).
TEST(Models, PublishedLlamaShapesHaveTheirParameterCountsAndFlops) {
  EXPECT_EQ(analytic_decoder_parameters(model_preset("llama3-1b")), 1235814400);
  EXPECT_EQ(analytic_decoder_parameters(model_preset("llama3-8b")), 8030261248);
  EXPECT_EQ(analytic_decoder_parameters(model_preset("llama3-70b")), 70553706496);
  EXPECT_EQ(analytic_decoder_parameters(model_preset("llama3-405b")), 405853388800);  // HF's config: 126 layers, d 16384, FFN 53248
  // torchtitan's get_dense_model_nparams_and_flops at seq 8192: 6·(N - embedding) + 12·L·H·Dh·S.
  EXPECT_DOUBLE_EQ(decoder_flops_per_token(model_preset("llama3-8b"), FlopConvention::Full), 57914449920.0);
  EXPECT_DOUBLE_EQ(decoder_flops_per_token(model_preset("llama3-70b"), FlopConvention::Full), 481442709504.0);
  // The causal convention counts half the attention term.
  const ModelShape& m = model_preset("llama3-8b");
  EXPECT_DOUBLE_EQ(decoder_flops_per_token(m, FlopConvention::Full) - decoder_flops_per_token(m, FlopConvention::Causal),
                   6.0 * m.layers * m.heads * m.head_dim() * m.seq_len);
}

// HF's LlamaForCausalLM built on the meta device (tests/parity/hf_llama.py) counts the same parameters
// for every llama preset, the published four included.
TEST(Models, LlamaParameterCountsEqualHuggingFacesModel) {
  const std::string python = std::string(test::kTorchVenv) + "/bin/python";
  if (std::string(test::kTorchVenv).empty()) GTEST_SKIP() << "no project virtual environment (a LibTorch of your own)";
  json shapes = json::object();
  for (const auto& p : model_presets())
    if (p.family == "llama") shapes[p.name] = p.to_json();
  const std::string in = tmp_dir() + "/llama-shapes.json", out = tmp_dir() + "/llama-counts.json";
  { std::ofstream(in) << shapes.dump(); }
  const int rc = std::system((python + " " + test::kSourceDir + "/tests/parity/hf_llama.py --count < " + in + " > " + out).c_str());
  if (WIFEXITED(rc) && WEXITSTATUS(rc) == 3) GTEST_SKIP() << "transformers is not installed (scripts/reference-packages.txt)";
  ASSERT_EQ(rc, 0);
  std::ifstream f(out);
  const json counts = json::parse(f);
  ASSERT_EQ(counts.size(), 6u);
  for (const auto& p : model_presets()) {
    if (p.family == "llama") {
      EXPECT_EQ(counts.at(p.name).get<int64_t>(), analytic_decoder_parameters(p)) << p.name;
    }
  }
}

TEST(Models, LlamaBuildsItsShapeAndIsCausalOnBothAttentionPaths) {
  ModelShape s = model_preset("llama-tiny");
  for (const std::string attention : {"eager", "sdpa"}) {
    s.attention = attention;
    torch::manual_seed(0);
    auto m = make_model(s, tokens_of("llama-tiny"));
    EXPECT_EQ(count_parameters(*m), m->analytic_parameters());
    // Grouped-query attention: K and V project to kv_heads x head_dim = 2 x 16.
    EXPECT_EQ(m->named_parameters()["block0.k_proj.weight"].sizes(), (std::vector<int64_t>{32, 64}));
    EXPECT_EQ(m->named_parameters()["lm_head.weight"].sizes(), (std::vector<int64_t>{256, 64}));  // untied
    m->eval();
    auto a = torch::randint(256, {1, 64}, torch::kLong);
    auto b = a.clone();
    b[0][40] = (b[0][40].item<int64_t>() + 1) % 256;
    auto la = m->forward(a), lb = m->forward(b);
    EXPECT_TRUE(torch::equal(la.slice(1, 0, 40), lb.slice(1, 0, 40))) << attention;
    EXPECT_FALSE(torch::allclose(la.slice(1, 40, 41), lb.slice(1, 40, 41))) << attention;
    EXPECT_EQ(m->attention_backend().empty(), false);
  }
  s.tied = true;  // a tied head has no matrix of its own
  EXPECT_EQ(count_parameters(*make_model(s, tokens_of("llama-tiny"))), analytic_decoder_parameters(s));
  EXPECT_EQ(analytic_decoder_parameters(model_preset("llama-tiny")) - analytic_decoder_parameters(s), 256 * 64);
}

// The GPT's and the ViT's SDPA path computes what their eager path does: the same products summed in
// another order. fp32 rounds each operation at 2^-24 relative; over 64-term dot products and a softmax
// of 64 entries on activations of order 1 that stays below 1e-5 absolute, and a wrong mask or scale
// would move the logits by far more.
TEST(Models, GptAndVitSdpaAgreeWithEagerAndSayWhichKernelRan) {
  for (const std::string name : {"gpt-tiny", "vit-tiny"}) {
    ModelShape s = model_preset(name);
    const bool lm = s.language_model();
    const torch::Tensor x = lm ? torch::randint(256, {2, 64}, torch::kLong) : torch::randn({2, 1, 28, 28});
    torch::Tensor out[2];
    std::string backend[2];
    int i = 0;
    for (const std::string attention : {"eager", "sdpa"}) {
      s.attention = attention;
      torch::manual_seed(0);  // the same weights on both paths
      auto m = make_model(s, lm ? tokens_of(name) : DataShape{});
      m->eval();
      out[i] = m->forward(x);
      backend[i++] = m->attention_backend();
    }
    EXPECT_TRUE(torch::allclose(out[0], out[1], 0, 1e-5)) << name << ": " << (out[0] - out[1]).abs().max().item<double>();
    EXPECT_EQ(backend[0], "eager") << name;
    EXPECT_NE(backend[1], "eager") << name;
    EXPECT_FALSE(backend[1].empty()) << name;
  }
}

TEST(Data, TextIsFortunesAsBytes) {
  if (!std::filesystem::exists(text_dir() + "/fortunes")) GTEST_SKIP() << "no fortunes (apt-get install fortunes)";
  const ModelPreset& llama = model_preset("llama-tiny");
  auto a = make_data("text", llama, 3), b = make_data("text", llama, 3);
  EXPECT_EQ(resolve_data("auto", llama), "text");
  const Batch x = a->train_batch(5, 4), y = b->train_batch(5, 4);
  EXPECT_TRUE(torch::equal(x.input, y.input));  // a pure function of (seed, step)
  EXPECT_EQ(x.input.sizes(), (std::vector<int64_t>{4, 64}));
  EXPECT_TRUE(torch::equal(x.input.slice(1, 1), x.target.slice(1, 0, 63)));  // next-byte targets
  EXPECT_GE(x.input.min().item<int64_t>(), 0);
  EXPECT_LT(x.input.max().item<int64_t>(), 256);
  // English: mostly lower-case letters and spaces.
  const double letters = ((x.input >= 'a') & (x.input <= 'z')).to(torch::kFloat).mean().item<double>();
  EXPECT_GT(letters, 0.5);
  ModelPreset small = llama;
  small.vocab = 100;
  EXPECT_NE(test::error_of([&] { make_data("text", small, 0); }).find("vocab must be at least 256"), std::string::npos);
  setenv("TRAINSCOPE_TEXT_DIR", "/nonexistent", 1);
  // A cell that would read it is skipped, saying which package brings it.
  RunConfig cell;
  cell.model = "llama-tiny";
  EXPECT_NE(unsupported_reason(cell, "cpu").find("apt-get install fortunes"), std::string::npos);
  try {
    make_data("text", llama, 0);
    ADD_FAILURE() << "no error for a missing corpus";
  } catch (const MissingData& e) {
    EXPECT_NE(std::string(e.what()).find("apt-get install fortunes"), std::string::npos) << e.what();
  }
  unsetenv("TRAINSCOPE_TEXT_DIR");
}

TEST(Models, GptIsCausal) {
  auto m = build("gpt-tiny", tokens_of("gpt-tiny"));
  m->eval();
  auto a = torch::randint(256, {1, 64}, torch::kLong);
  auto b = a.clone();
  b[0][40] = (b[0][40].item<int64_t>() + 1) % 256;  // change a later token
  auto la = m->forward(a), lb = m->forward(b);
  EXPECT_TRUE(torch::allclose(la.slice(1, 0, 40), lb.slice(1, 0, 40)));
  EXPECT_FALSE(torch::allclose(la.slice(1, 40, 41), lb.slice(1, 40, 41)));
}

TEST(Models, EveryCpuSizedPresetMatchesItsAnalyticCount) {
  for (const auto& p : model_presets()) {
    if (p.name == "gpt-125m" || p.name == "gpt-1b" || p.name == "mlp-large" || p.name.rfind("llama3", 0) == 0)
      continue;  // GPU sizes
    auto m = build(p.name, p.language_model() ? tokens_of(p.name) : DataShape{});
    EXPECT_EQ(count_parameters(*m), m->analytic_parameters()) << p.name;
  }
  // The GPU presets' analytic sizes: GPT-2 small's 124M, and 1.3B.
  ModelPreset big = model_preset("gpt-125m");
  const int64_t D = big.width;
  EXPECT_NEAR(static_cast<double>((big.vocab + big.seq_len) * D + big.layers * (12 * D * D + 13 * D) + 2 * D),
              124.5e6, 0.5e6);
}

TEST(Data, SyntheticStreamsAreDeterministicPerSeed) {
  const ModelPreset& gpt = model_preset("gpt-tiny");
  auto a = make_data("auto", gpt, 7), b = make_data("auto", gpt, 7), c = make_data("auto", gpt, 8);
  const Batch a3 = a->train_batch(3, 4), b3 = b->train_batch(3, 4), c3 = c->train_batch(3, 4);
  EXPECT_TRUE(torch::equal(a3.input, b3.input));
  EXPECT_FALSE(torch::equal(a3.input, c3.input));
  EXPECT_FALSE(torch::equal(a3.input, a->train_batch(4, 4).input));
  // Targets are the inputs shifted by one token.
  EXPECT_TRUE(torch::equal(a3.input.slice(1, 1, 64), a3.target.slice(1, 0, 63)));
  EXPECT_LT(a3.input.max().item<int64_t>(), 256);
}

TEST(Data, FashionMnistReadsDebiansFiles) {
  if (!fashion_mnist_available()) GTEST_SKIP() << "dataset-fashion-mnist not installed";
  auto d = make_data("fashion-mnist", model_preset("mlp"), 0);
  const Batch b = d->train_batch(0, 256);
  EXPECT_EQ(b.input.sizes(), (std::vector<int64_t>{256, 1, 28, 28}));
  EXPECT_GE(b.target.min().item<int64_t>(), 0);
  EXPECT_LE(b.target.max().item<int64_t>(), 9);
  EXPECT_NEAR(b.input.mean().item<double>(), 0.0, 0.15);  // standardised
  EXPECT_EQ(d->test_set().input.size(0), 10000);
  auto again = make_data("fashion-mnist", model_preset("mlp"), 0);
  EXPECT_TRUE(torch::equal(b.target, again->train_batch(0, 256).target));
}

TEST(Data, IdxReaderChecksTheFile) {
  const std::string path = tmp_dir() + "/tiny-idx3-ubyte.gz";
  auto write = [&](const std::vector<unsigned char>& bytes) {
    gzFile f = gzopen(path.c_str(), "wb");
    gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
    gzclose(f);
  };
  write({0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 3, 1, 2, 3, 4, 5, 6});
  const auto t = read_idx_gz(path);
  EXPECT_EQ(t.sizes(), (std::vector<int64_t>{2, 1, 3}));
  EXPECT_EQ(t[1][0][2].item<int>(), 6);
  write({0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 3, 1, 2});  // truncated
  EXPECT_THROW(read_idx_gz(path), std::runtime_error);
  write({0, 0, 13, 1, 0, 0, 0, 1, 9});  // float IDX: not ours
  EXPECT_THROW(read_idx_gz(path), std::runtime_error);
}

TEST(Precision, AutocastGuardClearsTheCastCacheEachStep) {
  // Under CPU autocast a bf16 copy of a weight is cached; after an in-place update the next
  // forward must see the new weight, which only holds if the guard clears the cache on exit.
  torch::manual_seed(0);
  torch::nn::Linear lin(8, 8);
  auto x = torch::randn({4, 8});
  auto forward = [&] {
    compat::AutocastGuard g(torch::kCPU, torch::kBFloat16);
    return lin->forward(x);
  };
  const auto before = forward();
  EXPECT_EQ(before.scalar_type(), torch::kBFloat16);
  {
    torch::NoGradGuard ng;
    lin->weight.add_(1.0);
  }
  const auto after = forward();
  const auto expected = torch::nn::functional::linear(x.to(torch::kBFloat16), lin->weight.to(torch::kBFloat16),
                                                      lin->bias.to(torch::kBFloat16));
  EXPECT_TRUE(torch::allclose(after.to(torch::kFloat), expected.to(torch::kFloat), 1e-2, 1e-2));
  EXPECT_FALSE(torch::allclose(after.to(torch::kFloat), before.to(torch::kFloat), 1e-2, 1e-2));
  EXPECT_FALSE(compat::autocast_enabled(torch::kCPU));  // state restored
}

// cross_entropy = fused against the eager loss, over three chunks of rows (V = 2^16: 256 rows per chunk,
// 520 rows). Tolerances from the arithmetic: both reduce exp over a row in fp32 by cascade summation,
// so each log-sum-exp is within log2(V) eps = 16 x 2^-24 ~ 1e-6 of exact, and the losses (means of
// them) differ by at most twice that, plus the rounding of the mean (~eps relative); the gradient
// (softmax - one_hot) g / N inherits exp(x - lse)'s relative error, |grad| <= g / N (below). In bf16
// the gradient is that fp32 value rounded to bf16 by both (eager: the cast's backward): equal, or
// one bf16 ulp (2^-7 of its binade) apart where the fp32 values straddle a rounding boundary.
TEST(Loss, FusedCrossEntropyIsTheEagerLossInBoundedScratch) {
  probes::AccountingAllocator::install();
  const int64_t N = 520, V = int64_t{1} << 16;
  ASSERT_EQ(kFusedLossChunkElements / V, 256);  // three chunks: 256, 256, 8
  torch::manual_seed(0);
  const torch::Tensor x32 = torch::randn({N, V}) * 3, target = torch::randint(V, {N});
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    const torch::Tensor base = x32.to(dtype);
    const double g = 3.0, eps = std::ldexp(1.0, -24), lse_error = 16 * eps;
    auto run = [&](const std::string& how, int64_t& kept, int64_t& forward_rise, int64_t& backward_rise) {
      const torch::Tensor logits = base.detach().clone().requires_grad_(true);
      const int64_t before = probes::AccountingAllocator::current();
      probes::AccountingAllocator::reset_peak();
      torch::Tensor loss = cross_entropy(logits, target, how);
      forward_rise = probes::AccountingAllocator::peak() - before;
      kept = probes::AccountingAllocator::current() - before;
      const int64_t mid = probes::AccountingAllocator::current();
      probes::AccountingAllocator::reset_peak();
      (loss * g).backward();
      backward_rise = probes::AccountingAllocator::peak() - mid;
      return std::make_pair(loss.detach(), logits.grad());
    };
    int64_t kept_e = 0, fwd_e = 0, bwd_e = 0, kept_f = 0, fwd_f = 0, bwd_f = 0;
    const auto [loss_e, grad_e] = run("eager", kept_e, fwd_e, bwd_e);
    const auto [loss_f, grad_f] = run("fused", kept_f, fwd_f, bwd_f);
    const double le = loss_e.item<double>();
    EXPECT_NEAR(loss_f.item<double>(), le, 2 * lse_error + 4 * eps * le);
    EXPECT_EQ(grad_f.scalar_type(), dtype);
    const torch::Tensor diff = (grad_f.to(torch::kFloat) - grad_e.to(torch::kFloat)).abs();
    // exp's argument x - lse is formed in up to three fp32 roundings of values below M = max|x| + max lse
    // by each: its difference, and so p's relative one, is at most 6 eps M plus the two sums' errors.
    const double M = base.abs().max().item<double>() + base.to(torch::kFloat).logsumexp(1).max().item<double>();
    const double bound = dtype == torch::kFloat ? (6 * eps * M + 2 * lse_error + 2 * eps) * g / N : std::ldexp(1.0, -7) * g / N;
    EXPECT_LE(diff.max().item<double>(), bound);
    EXPECT_GT(grad_f.abs().sum().item<double>(), 0.0);
    // What each keeps for backward beyond its inputs: the fp32 log-probabilities (eager), the fp32
    // log-sum-exp per row (fused; the loss itself 4 bytes more).
    EXPECT_GE(kept_e, N * V * 4);
    EXPECT_LE(kept_f, N * 4 + 64);
    // Fused scratch is a chunk's, whatever N x V: an fp32 copy (bf16 only) and the shifted exponentials,
    // and a column of the chunk's rows (forward: the row maxima; backward: the -1s of the one-hot).
    const int64_t chunk = 256 * V * 4 * (dtype == torch::kFloat ? 1 : 2) + 256 * 4;
    EXPECT_LE(fwd_f, chunk + N * 16 + 1024);
    EXPECT_LE(bwd_f, N * V * static_cast<int64_t>(base.element_size()) + chunk + 1024);
    EXPECT_GT(fwd_e, N * V * 4);
  }
}

class LossFalls : public ::testing::TestWithParam<std::tuple<std::string, std::string, std::string>> {};

TEST_P(LossFalls, ShortTraining) {
  const auto& [model, data, precision] = GetParam();
  RunConfig c;
  c.model = model;
  c.data = data;
  c.precision = precision;
  c.batch_size = 32;
  c.steps = 40;
  c.warmup_steps = 0;
  c.lr = model == "gpt-tiny" || model == "llama-tiny" ? 3e-3 : model == "cnn-tiny" ? 1e-2 : 1e-3;
  c.log_every = 1;
  c.eval = false;
  Trainer t(c, "cpu");
  Hooks none;
  const TrainOutcome o = train(t, c, none, t.info());
  ASSERT_EQ(o.status, "ok") << o.reason;
  ASSERT_GE(o.loss_curve.size(), 40u);
  const double first = o.loss_curve.front().second;
  EXPECT_LT(o.final_loss, 0.7 * first) << model << " " << precision << ": " << first << " -> " << o.final_loss;
  // Model state measured from the live tensors equals the analytic fp32 + AdamW accounting.
  const ModelStateBytes m = t.model_state();
  EXPECT_EQ(m.params, t.model().analytic_parameters() * 4);
  EXPECT_EQ(m.grads, m.params);
  EXPECT_EQ(m.optimizer, 2 * m.params);
  EXPECT_EQ(m.params + m.grads + m.optimizer, m.expected);
}

INSTANTIATE_TEST_SUITE_P(Models, LossFalls,
                         ::testing::Values(std::make_tuple("mlp-tiny", "synthetic-images", "32-true"),
                                           std::make_tuple("cnn-tiny", "synthetic-images", "32-true"),
                                           std::make_tuple("gpt-tiny", "synthetic-tokens", "32-true"),
                                           std::make_tuple("gpt-tiny", "synthetic-tokens", "bf16-mixed"),
                                           std::make_tuple("llama-tiny", "text", "32-true"),
                                           std::make_tuple("llama-tiny", "synthetic-tokens", "bf16-mixed")));

TEST(Trainer, UnsupportedCellsSayWhy) {
  RunConfig c;
  c.precision = "tf32";
  EXPECT_NE(unsupported_reason(c, "cpu").find("tf32 needs a CUDA GPU"), std::string::npos);
  c.precision = "32-true";
  c.model = "gpt-tiny";
  c.data = "fashion-mnist";
  EXPECT_NE(unsupported_reason(c, "cpu").find("needs token data"), std::string::npos);
  c.model = "mlp";
  c.data = "text";
  EXPECT_NE(unsupported_reason(c, "cpu").find("needs image data"), std::string::npos);
  c.attention = "sdpa";
  c.data = "auto";
  EXPECT_NE(unsupported_reason(c, "cpu").find("has no attention"), std::string::npos);
  c.attention = "auto";
  c.model = "llama-tiny";
  c.dropout = 0.1;
  EXPECT_NE(unsupported_reason(c, "cpu").find("Llama 3 has no dropout"), std::string::npos);
  c.dropout = 0;
  c.model = "gpt-tiny";
  c.data = "auto";
  EXPECT_EQ(unsupported_reason(c, "cpu"), "");
  if (!torch::cuda::is_available()) {
    EXPECT_NE(unsupported_reason(c, "cuda:0").find("no CUDA device"), std::string::npos);
  }
}
