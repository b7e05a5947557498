// Activation checkpointing, the memory budget and the frontier search.
#include <gtest/gtest.h>

#include "core/errors.hpp"
#include "probes/step/memory.hpp"
#include "runners/commands/frontier.hpp"
#include "suites/techniques/checkpoint.hpp"
#include "suites/models/models.hpp"

using namespace trainscope;
using namespace trainscope::suites;

namespace {

// A GPT with dropout on, so that a recomputation that draws other masks gives other gradients.
std::shared_ptr<ReferenceModel> gpt(int64_t layers, double dropout, const CheckpointPolicy& policy) {
  ModelPreset p = model_preset("gpt-tiny");
  p.layers = layers;
  p.dropout = dropout;
  DataShape shape;
  shape.vocab = p.vocab;
  shape.seq_len = p.seq_len;
  torch::manual_seed(0);
  auto m = make_model(p, shape);
  m->set_checkpoint(policy);
  return m;
}

Batch batch() {
  auto g = at::detail::createCPUGenerator(7);
  auto t = torch::randint(256, {4, 65}, g, torch::kLong);
  return {t.slice(1, 0, 64).contiguous(), t.slice(1, 1, 65).contiguous()};
}

std::vector<torch::Tensor> gradients(const std::string& policy_text, bool restore_rng = true) {
  CheckpointPolicy policy = CheckpointPolicy::parse(policy_text);
  policy.restore_rng = restore_rng;
  auto m = gpt(2, 0.1, policy);
  torch::manual_seed(123);  // the same dropout stream for every policy
  m->loss(batch()).backward();
  std::vector<torch::Tensor> g;
  for (const auto& p : m->parameters()) g.push_back(p.grad().clone());
  return g;
}

// A Llama (grouped-query attention, unbiased projections) under a policy: every parameter's gradient.
std::vector<torch::Tensor> llama_gradients(const std::string& policy_text, const std::string& attention) {
  ModelPreset p = model_preset("llama-tiny");
  p.layers = 2;
  p.attention = attention;
  torch::manual_seed(0);
  auto m = make_llama(p);
  m->set_checkpoint(CheckpointPolicy::parse(policy_text));
  auto g = at::detail::createCPUGenerator(7);
  auto t = torch::randint(p.vocab, {2, p.seq_len + 1}, g, torch::kLong);
  m->loss({t.slice(1, 0, p.seq_len).contiguous(), t.slice(1, 1, p.seq_len + 1).contiguous()}).backward();
  std::vector<torch::Tensor> out;
  for (const auto& q : m->parameters()) out.push_back(q.grad().defined() ? q.grad().clone() : torch::Tensor());
  return out;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!torch::equal(a[i], b[i])) return false;
  return true;
}

}  // namespace

TEST(Checkpoint, GradientsEqualNoCheckpointingBitForBitWithDropout) {
  const auto reference = gradients("none");
  for (const char* policy : {"full", "every:2", "selective"})
    EXPECT_TRUE(all_equal(gradients(policy), reference)) << policy;
}

// selective-op serves the kept outputs to the recomputation through each operator's own backward, in
// the graph aten::linear, at::matmul and SDPA build: the engine sums the same contributions in the
// same order, so the gradients are those of no checkpointing, bit for bit (GPT: biased linears, eager
// attention's bmm; Llama: every other unbiased projection, and the flash kernel on the SDPA path).
TEST(Checkpoint, SelectiveOpGradientsEqualNoCheckpointingBitForBit) {
  EXPECT_TRUE(all_equal(gradients("selective-op"), gradients("none")));
  for (const std::string attention : {"eager", "sdpa"}) {
    const auto reference = llama_gradients("none", attention);
    for (const char* policy : {"selective-op", "selective", "full"}) {
      const auto g = llama_gradients(policy, attention);
      ASSERT_EQ(g.size(), reference.size());
      for (size_t i = 0; i < g.size(); ++i) {
        ASSERT_TRUE(g[i].defined()) << policy << " " << attention << " parameter " << i << " has no gradient";
        EXPECT_TRUE(torch::equal(g[i], reference[i]))
            << policy << " " << attention << " parameter " << i << ": max |diff| " << (g[i] - reference[i]).abs().max().item<double>();
      }
    }
  }
}

TEST(Checkpoint, WithoutTheRngRestoreTheGradientsDiffer) {
  const auto reference = gradients("none");
  EXPECT_FALSE(all_equal(gradients("full", /*restore_rng=*/false), reference));
  EXPECT_FALSE(all_equal(gradients("selective", /*restore_rng=*/false), reference));
}

TEST(Checkpoint, ABlockWhoseInputNeedsNoGradientStillTrainsItsParameters) {
  torch::manual_seed(0);
  torch::nn::Linear lin(8, 8);
  const auto x = torch::randn({3, 8});  // requires no grad
  ASSERT_FALSE(x.requires_grad());
  const BlockFn fn = [&](const torch::Tensor& in) { return torch::tanh(lin->forward(in)); };
  fn(x).sum().backward();
  const auto w_ref = lin->weight.grad().clone(), b_ref = lin->bias.grad().clone();
  lin->zero_grad();
  const std::vector<torch::Tensor> params = lin->parameters();
  checkpoint(fn, x, params).sum().backward();
  ASSERT_TRUE(lin->weight.grad().defined());
  EXPECT_TRUE(torch::equal(lin->weight.grad(), w_ref));
  EXPECT_TRUE(torch::equal(lin->bias.grad(), b_ref));
}

TEST(Checkpoint, FullKeepsAtMost40PercentOfTheActivationsOfAnEightBlockModel) {
  probes::AccountingAllocator::install();
  auto activation_bytes = [](const std::string& policy) {
    auto m = gpt(8, 0.0, CheckpointPolicy::parse(policy));
    const Batch b = batch();
    const int64_t before = probes::AccountingAllocator::current();
    auto loss = m->loss(b);  // everything kept for backward is live now
    const int64_t kept = probes::AccountingAllocator::current() - before;
    loss.backward();
    return kept;
  };
  const int64_t none = activation_bytes("none"), full = activation_bytes("full");
  EXPECT_GT(none, 0);
  EXPECT_LE(static_cast<double>(full), 0.40 * static_cast<double>(none)) << full << " vs " << none;
  EXPECT_LT(activation_bytes("every:2"), none);
}

TEST(Checkpoint, PolicyTextAndRecomputeFlops) {
  EXPECT_EQ(CheckpointPolicy::parse("every:3").every, 3);
  EXPECT_TRUE(CheckpointPolicy::parse("every:3").checkpoints_block(6));
  EXPECT_FALSE(CheckpointPolicy::parse("every:3").checkpoints_block(4));
  EXPECT_THROW(CheckpointPolicy::parse("every:0"), UsageError);
  EXPECT_THROW(CheckpointPolicy::parse("partial"), UsageError);
  // full recomputes every block's forward: 2 blocks of (2·12·D² + 4·D·S) per token, S tokens (the
  // full-attention convention: QK^T and AV over all S x S pairs).
  const double D = 64, S = 64;
  EXPECT_DOUBLE_EQ(gpt(2, 0, CheckpointPolicy::parse("full"))->recompute_flops_per_sample(),
                   2 * (2 * 12 * D * D + 4 * D * S) * S);
  EXPECT_DOUBLE_EQ(gpt(2, 0, CheckpointPolicy::parse("selective"))->recompute_flops_per_sample(), 2 * 4 * D * S * S);
  EXPECT_DOUBLE_EQ(gpt(2, 0, CheckpointPolicy::parse("none"))->recompute_flops_per_sample(), 0);
}

TEST(MemoryBudget, AnAllocationPastTheBudgetRaisesOutOfMemory) {
  probes::AccountingAllocator::install();
  const int64_t live = probes::AccountingAllocator::current();
  probes::AccountingAllocator::set_budget(live + 10000);
  probes::AccountingAllocator::set_phase("forward");
  auto fits = torch::empty({2000}, torch::kFloat);  // 8000 B: within
  try {
    auto too_much = torch::empty({1000}, torch::kFloat);  // 4000 more: past the budget
    ADD_FAILURE() << "no out-of-memory error";
  } catch (const c10::OutOfMemoryError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("out of memory in forward: asked for 4000 bytes"), std::string::npos) << what;
  }
  probes::AccountingAllocator::set_budget(0);
  auto now_fine = torch::empty({1000}, torch::kFloat);
  EXPECT_EQ(now_fine.numel(), 1000);
}

TEST(Frontier, FindsTheKnownLargestBatchOfASyntheticMemoryModel) {
  // Memory = 1000 + 37 per sample, budget 5000: the largest batch is 108.
  auto fits = [](int64_t b) { return 1000 + 37 * b <= 5000; };
  const auto r = runners::frontier_search(fits, 8, 4096);
  EXPECT_EQ(r.largest_fit, 108);
  EXPECT_EQ(r.first_fail, 109);
  EXPECT_EQ(r.tries.front().first, 8);
  EXPECT_TRUE(r.tries.front().second);
  EXPECT_LE(r.tries.size(), 12u);  // 8, 16, 32, 64, 128, then bisection
  // Below the start, and a limit that always fits.
  EXPECT_EQ(runners::frontier_search([](int64_t b) { return b <= 3; }, 8, 4096).largest_fit, 3);
  EXPECT_EQ(runners::frontier_search([](int64_t) { return true; }, 8, 100).largest_fit, 100);
  EXPECT_EQ(runners::frontier_search([](int64_t) { return false; }, 8, 100).largest_fit, 0);
}
