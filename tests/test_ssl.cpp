// Self-supervised pre-training: the losses against hand-computed values, the EMA schedule, kNN and the
// probes on constructed data, the collapse probe, the gathered negatives against one process, and the
// `ssl` suite's cells through the CLI.
#include <cmath>
#include <thread>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "cli_support.hpp"
#include "probes/ssl/health.hpp"
#include "suites/parallel/comm.hpp"
#include "suites/ssl/augment.hpp"
#include "suites/ssl/evaluate.hpp"
#include "suites/ssl/methods.hpp"
#include "test_support.hpp"

using namespace trainscope;
using namespace trainscope::test;
namespace ssl = trainscope::suites::ssl;

namespace {

torch::Tensor rows(std::initializer_list<std::initializer_list<float>> r) {
  std::vector<torch::Tensor> out;
  for (const auto& row : r) out.push_back(torch::tensor(std::vector<float>(row)));
  return torch::stack(out);
}

}  // namespace

TEST(SslLosses, NtXentWithKnownSimilarities) {
  // Two samples, each view equal to its pair and orthogonal to the other sample: every anchor has
  // one positive at cosine 1 and two negatives at cosine 0, so each anchor's loss is
  // -log(e^{1/t} / (e^{1/t} + 2)) = log(1 + 2 e^{-1/t}), and so is their mean.
  const torch::Tensor z1 = rows({{1, 0}, {0, 1}}), z2 = rows({{3, 0}, {0, 0.5}});  // norms do not matter
  for (double t : {0.5, 0.1}) EXPECT_NEAR(ssl::nt_xent(z1, z2, t).item<double>(), std::log(1 + 2 * std::exp(-1 / t)), 1e-6);
  // At collapse every candidate is as similar as the positive: ln(2N - 1) with N = 2.
  const torch::Tensor same = rows({{1, 1}, {1, 1}});
  EXPECT_NEAR(ssl::nt_xent(same, same, 0.5).item<double>(), std::log(3.0), 1e-6);
  // One sample per view: its only candidate is its positive, loss 0.
  EXPECT_NEAR(ssl::nt_xent(rows({{1, 2}}), rows({{-3, 1}}), 0.5).item<double>(), 0.0, 1e-6);
}

TEST(SslLosses, ByolAtIdenticalOrthogonalAndOppositeVectors) {
  const torch::Tensor p = rows({{1, 0}, {0, 2}});
  EXPECT_NEAR(ssl::byol_loss(p, p * 5).item<double>(), 0.0, 1e-6);          // cos 1
  EXPECT_NEAR(ssl::byol_loss(p, rows({{0, 1}, {1, 0}})).item<double>(), 2.0, 1e-6);  // cos 0
  EXPECT_NEAR(ssl::byol_loss(p, -p).item<double>(), 4.0, 1e-6);             // cos -1
}

TEST(SslLosses, DinoWithKnownCentre) {
  // K = 2, centre (0.5, 0.5), teacher temperature 0.5, student temperature 1.
  // Teacher view 1 (1, 0) -> centred (0.5, -0.5) / 0.5 = (1, -1) -> P = (s, 1 - s), s = 1/(1 + e^-2);
  // teacher view 2 -> (1 - s, s). Student view 1 (0, 0) -> log-probs (-ln 2, -ln 2); student view 2
  // (ln 3, 0) -> log-probs (ln 3/4, ln 1/4). Pairs (teacher 1, student 2) and (teacher 2, student 1):
  // CE1 = -(s ln 3/4 + (1 - s) ln 1/4), CE2 = ln 2; the loss is their mean.
  const double s = 1 / (1 + std::exp(-2.0));
  const double ce1 = -(s * std::log(0.75) + (1 - s) * std::log(0.25)), ce2 = std::log(2.0);
  const torch::Tensor t1 = rows({{1, 0}}), t2 = rows({{0, 1}}), s1 = rows({{0, 0}}), s2 = rows({{static_cast<float>(std::log(3.0)), 0}});
  const torch::Tensor center = rows({{0.5, 0.5}});
  EXPECT_NEAR(ssl::dino_loss({s1, s2}, {t1, t2}, center, 1.0, 0.5).item<double>(), (ce1 + ce2) / 2, 1e-6);
}

TEST(SslLosses, MaeOnAFixedMask) {
  // Two patches of four pixels; only patch 0 is masked, so patch 1's error does not count.
  const torch::Tensor target = torch::tensor({1.f, 2.f, 3.f, 4.f, 9.f, 9.f, 9.f, 9.f}).view({1, 2, 4});
  const torch::Tensor mask = torch::tensor({1.f, 0.f}).view({1, 2});
  const torch::Tensor zeros = torch::zeros_like(target);
  // Raw pixels: mean of 1, 4, 9, 16 = 7.5.
  EXPECT_NEAR(ssl::mae_loss(zeros, target, mask, false).item<double>(), 7.5, 1e-6);
  // norm_pix: (x - 2.5) / sqrt(var + 1e-6) with the unbiased var 5/3; the squares sum to
  // 3 var / (var + 1e-6), their mean is a quarter of that.
  const double var = 5.0 / 3.0;
  EXPECT_NEAR(ssl::mae_loss(zeros, target, mask, true).item<double>(), 0.75 * var / (var + 1e-6), 1e-6);
  // A perfect prediction of the normalised patch scores 0.
  const torch::Tensor perfect = (target - 2.5) / std::sqrt(var + 1e-6);
  EXPECT_NEAR(ssl::mae_loss(perfect, target, mask, true).item<double>(), 0.0, 1e-6);
}

TEST(SslLosses, EmaScheduleRisesFromBaseToOneByACosine) {
  EXPECT_DOUBLE_EQ(ssl::ema_momentum(0.99, 0, 100), 0.99);
  EXPECT_NEAR(ssl::ema_momentum(0.99, 50, 100), 0.995, 1e-12);  // cos(pi/2) = 0: half way
  EXPECT_NEAR(ssl::ema_momentum(0.99, 25, 100), 1 - 0.01 * (std::cos(M_PI / 4) + 1) / 2, 1e-12);
  EXPECT_DOUBLE_EQ(ssl::ema_momentum(0.99, 100, 100), 1.0);
  EXPECT_DOUBLE_EQ(ssl::ema_momentum(0.99, 150, 100), 1.0);  // past the end it stays at 1
}

TEST(SslEval, KnnWeightsVotesBySimilarity) {
  // Query (1, 0). Class 0: two bank entries at cosine 0.5; class 1: one at cosine 0.9; k = 3.
  // Majority would say 0; weights exp(sim / 0.07) give class 1 e^{12.9} against 2 e^{7.1}.
  const double a = std::acos(0.5), b = std::acos(0.9);
  const torch::Tensor bank = rows({{static_cast<float>(std::cos(a)), static_cast<float>(std::sin(a))},
                                   {static_cast<float>(std::cos(a)), static_cast<float>(-std::sin(a))},
                                   {static_cast<float>(std::cos(b)), static_cast<float>(std::sin(b))},
                                   {-1, 0}});
  const torch::Tensor labels = torch::tensor({0, 0, 1, 0}, torch::kLong);
  const torch::Tensor query = rows({{1, 0}}), truth = torch::tensor({1}, torch::kLong);
  EXPECT_DOUBLE_EQ(ssl::knn_accuracy(bank, labels, query, truth, 3, 0.07, 2), 1.0);
  // With a temperature of 10 the weights are nearly equal: the two class-0 votes win.
  EXPECT_DOUBLE_EQ(ssl::knn_accuracy(bank, labels, query, truth, 3, 10.0, 2), 0.0);
  // k = 1: the single nearest entry decides.
  EXPECT_DOUBLE_EQ(ssl::knn_accuracy(bank, labels, query, truth, 1, 10.0, 2), 1.0);
}

TEST(SslEval, LinearProbeSeparatesSeparableFeaturesAndNotNoise) {
  torch::manual_seed(3);
  const torch::Tensor y = torch::randint(4, {800}, torch::kLong), yt = torch::randint(4, {400}, torch::kLong);
  const torch::Tensor centres = torch::randn({4, 16}) * 4;
  const torch::Tensor x = centres.index({y}) + torch::randn({800, 16}), xt = centres.index({yt}) + torch::randn({400, 16});
  EXPECT_GT(ssl::linear_probe(x, y, xt, yt, 20, 0, 4), 0.97);
  // Labels independent of the features: chance is 1/4; 400 test samples put 3 standard deviations
  // at 0.25 + 3 sqrt(0.25 x 0.75 / 400) = 0.315.
  EXPECT_LT(ssl::linear_probe(torch::randn({800, 16}), y, torch::randn({400, 16}), yt, 20, 0, 4), 0.315);
}

TEST(SslEval, LabelSubsetsAreClassBalancedNestedBySeedOnly) {
  const torch::Tensor labels = torch::arange(1000, torch::kLong) % 10;
  const torch::Tensor a = ssl::label_subset(labels, 0.1, 0, 10), again = ssl::label_subset(labels, 0.1, 0, 10);
  EXPECT_EQ(a.size(0), 100);
  EXPECT_TRUE(torch::equal(a, again));
  EXPECT_TRUE(torch::equal(torch::bincount(labels.index({a}), {}, 10), torch::full({10}, 10, torch::kLong)));
  EXPECT_FALSE(torch::equal(a, ssl::label_subset(labels, 0.1, 1, 10)));
  EXPECT_EQ(ssl::label_subset(labels, 1.0, 2, 10).size(0), 1000);
}

TEST(SslViews, DrawnFromTheGeneratorAndInsideThePixelRange) {
  const torch::Tensor images = (torch::rand({8, 1, 28, 28}) - suites::kPixelMean) / suites::kPixelStd;
  auto g1 = at::detail::createCPUGenerator(5), g2 = at::detail::createCPUGenerator(5), g3 = at::detail::createCPUGenerator(6);
  const torch::Tensor a = ssl::make_view(images, ssl::byol_view(1), g1), b = ssl::make_view(images, ssl::byol_view(1), g2);
  EXPECT_TRUE(torch::equal(a, b));  // the same generator state, the same views
  EXPECT_FALSE(torch::equal(a, ssl::make_view(images, ssl::byol_view(1), g3)));
  EXPECT_FALSE(torch::equal(a, images));
  // Pixels stay in [0, 1] after crop, jitter and solarisation (normalised back with mean and std).
  const torch::Tensor px = a * suites::kPixelStd + suites::kPixelMean;
  EXPECT_GE(px.min().item<double>(), -1e-5);
  EXPECT_LE(px.max().item<double>(), 1 + 1e-5);
  // A flip alone (crop of the whole area at aspect 1 is not drawn: aspects vary) keeps the pixel mass
  // of each image up to the bilinear resampling of a crop inside it: the view's mean pixel stays in [0, 1].
  EXPECT_EQ(a.sizes(), images.sizes());
}

TEST(SslHealth, FlagsAConstantEncoderAndClearsAHealthyOne) {
  torch::manual_seed(1);
  probes::SslHealthProbe healthy(1), constant(1);
  for (int64_t step = 0; step < 3; ++step) {
    EmbeddingSample h;
    h.step = step;
    h.embeddings = torch::randn({256, 32});
    h.loss = 4.0;
    h.collapse_loss = std::log(511.0);
    healthy.embeddings(h);
    EmbeddingSample c = h;
    // From step 1 on every sample maps to the same vector (up to noise far below the threshold).
    c.embeddings = step == 0 ? torch::randn({256, 32}) : torch::ones({256, 32}) + 1e-6 * torch::randn({256, 32});
    constant.embeddings(c);
  }
  const json ok = healthy.section(), bad = constant.section();
  EXPECT_EQ(ok["verdict"], "healthy") << ok.dump();
  // Gaussian rows on the sphere: per-dimension std close to 1/sqrt(32) = 0.177 (256 samples: within 15%).
  EXPECT_NEAR(ok["samples"][0]["embedding_std"].get<double>(), 1 / std::sqrt(32.0), 0.15 / std::sqrt(32.0));
  EXPECT_GT(ok["samples"][0]["rankme"].get<double>(), 20.0);  // of 32 dimensions
  EXPECT_EQ(bad["verdict"], "collapsed") << bad.dump();
  EXPECT_EQ(bad["collapse_step"], 1);
  EXPECT_LT(bad["samples"][2]["rankme"].get<double>(), probes::kCollapseRank);
  // The loss criterion alone: healthy embeddings but a SimCLR loss stuck at ln(2N - 1).
  probes::SslHealthProbe stuck(1);
  EmbeddingSample s;
  s.embeddings = torch::randn({256, 32});
  s.loss = std::log(511.0) * 0.999;
  s.collapse_loss = std::log(511.0);
  stuck.embeddings(s);
  EXPECT_EQ(stuck.section()["verdict"], "collapsed");
  // DINO's KL: teacher and student distributions equal.
  probes::SslHealthProbe dino(1);
  s.loss = 1.0;
  s.teacher_probs = s.student_probs = torch::softmax(torch::randn({256, 16}), 1);
  dino.embeddings(s);
  EXPECT_EQ(dino.section()["verdict"], "collapsed");
  EXPECT_NEAR(dino.section()["samples"][0]["kl"].get<double>(), 0.0, 1e-6);
}

TEST(SslDistributed, GatheredNegativesEqualOneProcessOnTheGlobalBatch) {
  // Two ranks in two threads over Gloo. Each computes NT-Xent of its 3 anchors against the gathered
  // 6; the mean of the two losses is the one-process loss on the 6, and each rank's gradient of its
  // own rows (the gather's backward sums them over the ranks) is 2x the one-process gradient of those
  // rows: DDP's averaging over the 2 ranks then gives exactly the one-process parameter gradient.
  // Tolerance: the same float32 sums in another order, a few ulps of values of order 1 -> 1e-5.
  c10d::TCPStoreOptions opts;
  opts.port = 0;
  opts.isServer = true;
  opts.waitWorkers = false;  // the ranks connect after the server exists
  auto server = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", opts);
  const int port = server->getPort();
  torch::manual_seed(11);
  const torch::Tensor g1 = torch::randn({6, 8}), g2 = torch::randn({6, 8});
  torch::Tensor one1 = g1.clone().requires_grad_(true), one2 = g2.clone().requires_grad_(true);
  const torch::Tensor one_loss = ssl::nt_xent(one1, one2, 0.5);
  one_loss.backward();
  double losses[2] = {0, 0};
  torch::Tensor grads1[2], grads2[2];
  auto rank = [&](int r) {
    suites::Communicator comm(suites::Rendezvous{"127.0.0.1", port, "gather", r, 2}, "gloo", torch::Device("cpu"), 30);
    torch::Tensor z1 = g1.narrow(0, 3 * r, 3).clone().requires_grad_(true), z2 = g2.narrow(0, 3 * r, 3).clone().requires_grad_(true);
    const torch::Tensor loss = ssl::nt_xent(z1, z2, 0.5, ssl::gather_with_grad(z1, &comm), ssl::gather_with_grad(z2, &comm), 3 * r);
    loss.backward();
    losses[r] = loss.item<double>();
    grads1[r] = z1.grad();
    grads2[r] = z2.grad();
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  EXPECT_NEAR((losses[0] + losses[1]) / 2, one_loss.item<double>(), 1e-5);
  EXPECT_NE(losses[0], losses[1]);  // each rank's anchors differ
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(torch::allclose(grads1[r], 2 * one1.grad().narrow(0, 3 * r, 3), 1e-5, 1e-6)) << r;
    EXPECT_TRUE(torch::allclose(grads2[r], 2 * one2.grad().narrow(0, 3 * r, 3), 1e-5, 1e-6)) << r;
  }
  // Without the gather (local negatives) the losses average to something else: 4 candidates, not 10.
  const torch::Tensor local = ssl::nt_xent(g1.narrow(0, 0, 3), g2.narrow(0, 0, 3), 0.5);
  EXPECT_GT(std::abs(local.item<double>() - losses[0]), 1e-3);
}

// Every method end to end on synthetic images (seconds per cell), with the evaluation on two label
// fractions: the sections the report promises, with numbers in their ranges, and a valid report.
TEST(SslCli, EveryMethodTrainsIsEvaluatedAndValidates) {
  const SuiteRun run = run_suite_text("ssl-mini", R"(
name = "ssl-mini"
[base]
data = "synthetic-images"
batch_size = 32
steps = 8
warmup_steps = 1
ssl_eval = "full"
label_fractions = "0.1,1"
label_seeds = 3
probe_epochs = 2
finetune_steps = 8
scratch_steps = 16
overflow_every = 0
dino_prototypes = 64
[axes]
model = ["cnn-tiny", "vit-tiny"]
method = ["supervised", "simclr", "byol", "dino", "mae"]
)");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const Result valid = validate_report(run.out + "/report.json");
  EXPECT_EQ(valid.code, 0) << valid.out;
  const json& report = run.report;
  const json mae_cnn = cell_named(report, "cnn-tiny/mae");
  EXPECT_EQ(mae_cnn["status"], "skipped");
  EXPECT_NE(mae_cnn["reason"].get<std::string>().find("needs a vit"), std::string::npos) << mae_cnn["reason"];
  for (const std::string model : {"cnn-tiny", "vit-tiny"})
    for (const std::string method : {"simclr", "byol", "dino", "mae"}) {
      if (model == "cnn-tiny" && method == "mae") continue;
      const json c = cell_named(report, model + "/" + method);
      ASSERT_EQ(c["status"], "ok") << c.dump().substr(0, 400);
      const json& ssl = c["metrics"]["ssl"];
      EXPECT_EQ(ssl["method"], method);
      for (const std::string which : {"encoder", "random_encoder", "raw_pixels"})
        for (const std::string probe : {"knn", "linear"}) {
          const double acc = ssl["frozen"][which][probe].get<double>();
          EXPECT_GE(acc, 0.0);
          EXPECT_LE(acc, 1.0);
        }
      ASSERT_EQ(ssl["label_efficiency"].size(), 2u);
      const json& row = ssl["label_efficiency"][0];
      EXPECT_EQ(row["fraction"], 0.1);
      EXPECT_EQ(row["probe"].size(), 3u);
      EXPECT_EQ(row["finetune"].size(), 3u);
      EXPECT_GT(ssl["pretrain"]["wall_s"].get<double>(), 0.0);
      EXPECT_GT(ssl["eval_wall_s"].get<double>(), 0.0);
      const json& health = c["metrics"]["ssl_health"];
      EXPECT_GE(health["samples"].size(), 2u);
      EXPECT_TRUE(health["verdict"] == "healthy" || health["verdict"] == "collapsed") << health["verdict"];
      if (method == "dino") {
        EXPECT_TRUE(health["samples"][0]["kl"].is_number());
      }
      if (method == "simclr") {
        EXPECT_NEAR(health["collapse_loss"].get<double>(), std::log(2.0 * 32 - 1), 1e-9);
      }
    }
  // The raw-pixel floor does not depend on the encoder: one value in every cell (computed once).
  EXPECT_EQ(cell_named(report, "cnn-tiny/simclr")["metrics"]["ssl"]["frozen"]["raw_pixels"],
            cell_named(report, "vit-tiny/mae")["metrics"]["ssl"]["frozen"]["raw_pixels"]);
  // Supervised siblings record their from-scratch curves on the same subsets, ascending in steps.
  const json sup = cell_named(report, "vit-tiny/supervised")["metrics"]["ssl"]["label_efficiency"];
  ASSERT_EQ(sup.size(), 2u);
  ASSERT_EQ(sup[1]["scratch_curve"].size(), 3u);
  const json& curve = sup[1]["scratch_curve"][0];
  ASSERT_GE(curve.size(), 2u);
  EXPECT_EQ(curve.back()["steps"], 16);
  EXPECT_LT(curve.front()["seconds"].get<double>(), curve.back()["seconds"].get<double>());
  EXPECT_EQ(sup[0]["labels"], cell_named(report, "vit-tiny/simclr")["metrics"]["ssl"]["label_efficiency"][0]["labels"]);
  EXPECT_TRUE(report.contains("ssl"));
}

// The methods under the other axes: activation checkpointing recomputes the encoder's blocks without
// changing the arithmetic (fp32, the same kernels on the same inputs, dropout-free blocks: the losses
// agree to the last bits, 1e-6 relative leaves room for a summation order), and the autocast modes and
// the emulated fp16 with its loss scaler train the views to a finite loss.
TEST(SslCli, MethodsComposeWithPrecisionAndCheckpointing) {
  const SuiteRun run = run_suite_text("ssl-axes", R"(
name = "ssl-axes"
[base]
model = "vit-tiny"
method = "simclr"
data = "synthetic-images"
batch_size = 32
steps = 6
warmup_steps = 0
ssl_eval = "off"
overflow_every = 3
dino_prototypes = 64
[axes]
checkpoint = ["none", "full"]
[[cells]]
name = "simclr/bf16-mixed/every1"
model = "vit-tiny"
method = "simclr"
precision = "bf16-mixed"
checkpoint = "every:1"
[[cells]]
name = "byol/16-mixed"
model = "cnn-tiny"
method = "byol"
precision = "16-mixed"
[[cells]]
name = "dino/bf16-mixed/full"
model = "vit-tiny"
method = "dino"
precision = "bf16-mixed"
checkpoint = "full"
[[cells]]
name = "mae/16-mixed/full"
model = "vit-tiny"
method = "mae"
precision = "16-mixed"
checkpoint = "full"
)");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const json& report = run.report;
  const json none = cell_named(report, "ckpt-none"), full = cell_named(report, "ckpt-full");
  ASSERT_EQ(none["status"], "ok") << none.dump().substr(0, 400);
  ASSERT_EQ(full["status"], "ok") << full.dump().substr(0, 400);
  const double l0 = none["metrics"]["quality"]["final_loss"], l1 = full["metrics"]["quality"]["final_loss"];
  EXPECT_NEAR(l1, l0, 1e-6 * std::abs(l0));
  EXPECT_LT(full["metrics"]["memory"]["activation_bytes"].get<double>(), none["metrics"]["memory"]["activation_bytes"].get<double>());
  for (const std::string name : {"simclr/bf16-mixed/every1", "byol/16-mixed", "dino/bf16-mixed/full", "mae/16-mixed/full"}) {
    const json c = cell_named(report, name);
    ASSERT_EQ(c["status"], "ok") << name << ": " << c.value("reason", "");
    EXPECT_TRUE(std::isfinite(c["metrics"]["quality"]["final_loss"].get<double>())) << name;
  }
  // The emulated fp16 cells ran with the loss scaler.
  EXPECT_EQ(cell_named(report, "byol/16-mixed")["emulated"], true);
  EXPECT_TRUE(cell_named(report, "mae/16-mixed/full")["metrics"]["overflow"].contains("scale_trajectory"));
}

// Under DDP: the gathered negatives and their fault, the teacher stream and its fault, the DINO centre
// and synchronised projector BatchNorm, each visible in the report.
TEST(SslCli, DistributedSslFaultsAreVisible) {
  const SuiteRun run = run_suite_text("ssl-ddp", R"(
name = "ssl-ddp"
[base]
model = "cnn-tiny"
data = "synthetic-images"
parallel = "ddp"
world_size = 2
batch_size = 16
steps = 6
warmup_steps = 0
rng_every = 2
ssl_eval = "off"
overflow_every = 0
dino_prototypes = 64
[axes]
method = ["simclr", "byol", "dino"]
[[cells]]
name = "simclr/local-negatives"
method = "simclr"
inject = "local-negatives"
[[cells]]
name = "simclr/sync-bn"
method = "simclr"
projector_bn = "sync"
[[cells]]
name = "byol/teacher-drift"
method = "byol"
inject = "teacher-drift"
[[cells]]
name = "dino/teacher-drift"
method = "dino"
inject = "teacher-drift"
)", "--nproc 2");
  ASSERT_EQ(run.result.code, 0) << run.result.out;
  const json& report = run.report;
  const json simclr = cell_named(report, "simclr"), local = cell_named(report, "simclr/local-negatives");
  ASSERT_EQ(simclr["status"], "ok") << simclr.dump().substr(0, 400);
  // Global negatives: 2 ranks x 16 samples x 2 views = 64 candidates; local: 32.
  EXPECT_EQ(simclr["metrics"]["ssl"]["pretrain"]["negatives"], "global");
  EXPECT_EQ(simclr["metrics"]["ssl"]["pretrain"]["effective_batch"], 64);
  EXPECT_EQ(local["metrics"]["ssl"]["pretrain"]["negatives"], "per-rank");
  EXPECT_EQ(local["metrics"]["ssl"]["pretrain"]["effective_batch"], 32);
  EXPECT_NEAR(simclr["metrics"]["ssl_health"]["collapse_loss"].get<double>(), std::log(63.0), 1e-9);
  EXPECT_NEAR(local["metrics"]["ssl_health"]["collapse_loss"].get<double>(), std::log(31.0), 1e-9);
  // The gather is a collective of the step: the comm probe sees all-gathers only with global negatives.
  auto gathers = [](const json& c) {
    int64_t n = 0;
    for (const auto& k : c["metrics"]["comm"]["collectives"])
      if (k["op"] == "all-gather") n += k["count"].get<int64_t>();
    return n;
  };
  EXPECT_GT(gathers(simclr), 0);
  EXPECT_EQ(gathers(local), 0);
  EXPECT_EQ(cell_named(report, "simclr/sync-bn")["metrics"]["ssl"]["pretrain"]["projector_bn"], "synchronised");
  EXPECT_EQ(simclr["metrics"]["ssl"]["pretrain"]["projector_bn"], "per-rank");
  EXPECT_NE(cell_named(report, "simclr/sync-bn")["metrics"]["quality"]["loss_curve"], simclr["metrics"]["quality"]["loss_curve"]);
  for (const std::string method : {"byol", "dino"}) {
    const json clean = cell_named(report, method), drift = cell_named(report, method + "/teacher-drift");
    ASSERT_EQ(clean["status"], "ok") << clean.dump().substr(0, 400);
    EXPECT_EQ(rng_stream(clean, "teacher-parameters")["verdict"], "ok") << clean["metrics"]["rng"].dump();
    EXPECT_EQ(rng_stream(clean, "parameters")["verdict"], "ok");
    EXPECT_EQ(rng_stream(drift, "teacher-parameters")["verdict"], "violated") << drift["metrics"]["rng"].dump();
    EXPECT_EQ(rng_stream(drift, "parameters")["verdict"], "ok");  // only the teacher differs: the student is reduced
    EXPECT_EQ(clean["metrics"]["rng"]["violations"], 0);
  }
  EXPECT_EQ(cell_named(report, "dino")["metrics"]["ssl"]["pretrain"]["center"], "all-reduced over ranks");
}

// save_encoder / pretrained: a cell that starts from another's encoder with lr 0 scores exactly what
// the saver scored (a ViT has no BatchNorm statistics a step could move); a missing file is a one-line
// failure of that cell only.
TEST(SslCli, PretrainedEncoderIsTheSavedOne) {
  const SuiteRun run = run_suite_text("ssl-pre", R"(
name = "ssl-pre"
[base]
model = "vit-tiny"
method = "simclr"
data = "synthetic-images"
batch_size = 32
steps = 6
warmup_steps = 0
ssl_eval = "frozen"
probe_epochs = 2
overflow_every = 0
[[cells]]
name = "saver"
save_encoder = "encoders/{model}-{method}.pt"
[[cells]]
name = "loader"
pretrained = "encoders/vit-tiny-simclr.pt"
lr = 0.0
steps = 1
[[cells]]
name = "missing"
pretrained = "encoders/none.pt"
)");
  const json& report = run.report;
  ASSERT_FALSE(report.is_null()) << run.result.out;
  const json saver = cell_named(report, "saver"), loader = cell_named(report, "loader");
  ASSERT_EQ(saver["status"], "ok") << saver.dump().substr(0, 400);
  ASSERT_EQ(loader["status"], "ok") << loader.dump().substr(0, 400);
  EXPECT_EQ(saver["metrics"]["ssl"]["saved_encoder"], "vit-tiny-simclr.pt");
  EXPECT_EQ(loader["metrics"]["ssl"]["pretrained"], "vit-tiny-simclr.pt");
  EXPECT_EQ(loader["metrics"]["ssl"]["frozen"]["encoder"], saver["metrics"]["ssl"]["frozen"]["encoder"]);
  const json missing = cell_named(report, "missing");
  EXPECT_EQ(missing["status"], "failed");
  EXPECT_NE(missing["reason"].get<std::string>().find("pretrained: no encoder at"), std::string::npos) << missing["reason"];
  EXPECT_NE(run.result.code, 0);  // a failed cell fails the run, and the report is still written
}

TEST(SslCli, BadSslValuesAreOneLineErrors) {
  for (const std::string set : {"method=swav", "label_fractions=0.5,2", "projector_bn=global"}) {
    const Result r = ts("run --out " + tmp("ssl-bad") + " --set " + set);
    EXPECT_EQ(r.code, 2) << set << ": " << r.out;
    EXPECT_EQ(lines(r.out), 1) << r.out;
  }
}
