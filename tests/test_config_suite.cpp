// Suite files, configuration values and axis expansion.
#include <gtest/gtest.h>

#include "test_support.hpp"

#include "core/errors.hpp"
#include "core/model_shape.hpp"
#include "suites/suite_file.hpp"

using namespace trainscope;
using namespace trainscope::suites;

using trainscope::test::error_of;

namespace {

const char* kSuite = R"(
# a comment
name = "demo"
description = "two axes"
[base]
steps = 7
lr = 0.01
[axes]
precision = ["32-true", "bf16-mixed"]
model = ["mlp-tiny", "gpt-tiny", "cnn-tiny"]
batch_size = [8, 16]
[when.model.gpt-tiny]
lr = 0.003
)";

}  // namespace

TEST(SuiteFile, ExpandsAxesInFileOrderWithLabels) {
  const Suite s = parse_suite(kSuite, "demo.toml");
  ASSERT_EQ(s.axes.size(), 3u);
  EXPECT_EQ(s.axes[0].key, "precision");  // file order, not toml++'s sorted order
  EXPECT_EQ(s.axes[1].key, "model");
  const auto cells = expand(s);
  ASSERT_EQ(cells.size(), 12u);
  EXPECT_EQ(cells[0].name, "32-true/mlp-tiny/bs8");
  EXPECT_EQ(cells[1].name, "32-true/mlp-tiny/bs16");
  EXPECT_EQ(cells[11].name, "bf16-mixed/cnn-tiny/bs16");
  EXPECT_EQ(cells[1].config.batch_size, 16);
  EXPECT_EQ(cells[0].config.steps, 7);
  EXPECT_DOUBLE_EQ(cells[0].config.lr, 0.01);
  EXPECT_DOUBLE_EQ(cells[2].config.lr, 0.003);  // the gpt-tiny cell gets its `when` setting
  EXPECT_EQ(cells[2].config.model, "gpt-tiny");
}

TEST(SuiteFile, FilterAndOverrides) {
  Suite s = parse_suite(kSuite, "demo.toml");
  EXPECT_EQ(expand(s, "gpt-tiny/bs16$").size(), 2u);
  apply_override(s, "precision", "bf16-mixed");  // an axis collapses to the one value
  apply_override(s, "lr", 0.5);                  // beats base and `when`
  const auto cells = expand(s);
  ASSERT_EQ(cells.size(), 6u);
  for (const auto& c : cells) {
    EXPECT_EQ(c.config.precision, "bf16-mixed");
    EXPECT_DOUBLE_EQ(c.config.lr, 0.5);
  }
  EXPECT_NE(error_of([&] { expand(s, "(unclosed"); }).find("bad --filter"), std::string::npos);
}

TEST(SuiteFile, ErrorsNameTheKeyAndTheAllowedValues) {
  auto parse = [](const std::string& text) { return error_of([&] { parse_suite(text, "bad.toml"); }); };
  EXPECT_NE(parse("name='x'\n[base]\nbatchsize = 3\n").find("unknown key 'batchsize'"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[base]\nbatchsize = 3\n").find("allowed: model, family, layers"), std::string::npos);
  const std::string bad_value = parse("name='x'\n[axes]\nprecision = ['fp16']\n");
  EXPECT_NE(bad_value.find("unknown precision 'fp16'"), std::string::npos) << bad_value;
  EXPECT_NE(bad_value.find("32-true, tf32, bf16-mixed"), std::string::npos) << bad_value;
  EXPECT_NE(parse("name='x'\n[base]\nsteps = 0\n").find("must be at least 1"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[base]\nsteps = 'ten'\n").find("expected an integer"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[axes]\nmodel = []\n").find("non-empty list"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[when.model.mlp]\nlr=1\n").find("not an axis"), std::string::npos);
  EXPECT_NE(parse("name='x'\n[axes]\nmodel=['mlp']\n[when.model.cnn]\nlr=1\n").find("not a value of axis"),
            std::string::npos);
  EXPECT_NE(parse("name='x'\nextra = 1\n").find("unknown key"), std::string::npos);
  EXPECT_NE(parse("[base]\nsteps=1\n").find("missing 'name'"), std::string::npos);
  // A TOML syntax error names the line and column.
  EXPECT_NE(parse("name = 'x'\n[base\n").find("bad.toml:2:"), std::string::npos);
  EXPECT_NE(error_of([] { load_suite("no-such-suite"); }).find("built-in: checkpointing, gate, hardware, llama, parallel, parity, pitfalls, precision, quick, ssl"), std::string::npos);
}

TEST(SuiteFile, ExtraCellsBesideTheMatrix) {
  const Suite s = parse_suite(std::string(kSuite) + R"(
[[cells]]
name = "mlp/16-mixed/stress"
model = "mlp"
precision = "16-mixed"
loss_multiplier = 1e8
)", "demo.toml");
  const auto cells = expand(s);
  ASSERT_EQ(cells.size(), 13u);
  EXPECT_EQ(cells.back().name, "mlp/16-mixed/stress");
  EXPECT_EQ(cells.back().config.precision, "16-mixed");
  EXPECT_DOUBLE_EQ(cells.back().config.loss_multiplier, 1e8);
  EXPECT_EQ(cells.back().config.steps, 7);  // the base applies
  EXPECT_EQ(expand(s, "stress").size(), 1u);
  EXPECT_NE(error_of([] { parse_suite("name='x'\n[[cells]]\nmodel='mlp'\n", "c.toml"); }).find("needs a name"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_suite("name='x'\n[[cells]]\nname='a'\nprecision='fp4'\n", "c.toml"); })
                .find("unknown precision 'fp4'"),
            std::string::npos);
}

// [[pitfalls]] name cells of the suite and a kind the report knows; each mistake is one line naming it.
TEST(SuiteFile, PitfallsAreCheckedAgainstTheSuitesCells) {
  const std::string base = std::string(kSuite) + "[[cells]]\nname = \"stress\"\nloss_multiplier = 1e8\n";
  const Suite s = parse_suite(base + R"(
[[pitfalls]]
id = "p1"
kind = "fp16-range"
title = "fp16"
wrong = ["stress"]
fix = ["bf16-mixed/mlp-tiny/bs8"]
)", "p.toml");
  ASSERT_EQ(s.pitfalls.size(), 1u);
  EXPECT_EQ(s.pitfalls[0]["fix"], json::array({"bf16-mixed/mlp-tiny/bs8"}));  // a matrix cell counts
  EXPECT_EQ(suite_to_json(s)["pitfalls"][0]["id"], "p1");
  EXPECT_FALSE(suite_to_json(parse_suite(kSuite, "d.toml")).contains("pitfalls"));
  auto err = [&](const std::string& text) { return error_of([&] { parse_suite(base + text, "p.toml"); }); };
  EXPECT_NE(err("[[pitfalls]]\nid='a'\nkind='fp4'\nwrong=['stress']\nfix=['stress']\n").find("unknown pitfall kind 'fp4' (allowed: fp16-range, rng, memory, ssl-data)"),
            std::string::npos);
  EXPECT_NE(err("[[pitfalls]]\nid='a'\nkind='rng'\nwrong=['stres']\nfix=['stress']\n").find("pitfalls[0].wrong: no cell named 'stres'"),
            std::string::npos);
  EXPECT_NE(err("[[pitfalls]]\nid='a'\nkind='rng'\nwrong=['stress']\n").find("needs 'wrong' and 'fix' cells"), std::string::npos);
  EXPECT_NE(err("[[pitfalls]]\nkind='rng'\nwrong=['stress']\nfix=['stress']\n").find("needs an id"), std::string::npos);
  EXPECT_NE(err("[[pitfalls]]\nid='a'\nwhy='x'\n").find("pitfalls[0].why: unknown key"), std::string::npos);
  EXPECT_NE(err("[frontier]\ncells=[1]\n").find("frontier.cells: expected a list of cell names"), std::string::npos);
}

TEST(Config, ValuesAreCheckedAndParsed) {
  EXPECT_EQ(parse_value("batch_size", "32"), json(32));
  EXPECT_EQ(parse_value("eval", "false"), json(false));
  EXPECT_DOUBLE_EQ(parse_value("lr", "1e-3").get<double>(), 1e-3);
  EXPECT_NE(error_of([] { parse_value("batch_size", "32x"); }).find("expected a number"), std::string::npos);
  EXPECT_NE(error_of([] { parse_value("batch_size", "2.5"); }).find("expected an integer"), std::string::npos);
  EXPECT_NE(error_of([] { parse_value("device", "gpu"); }).find("allowed: auto, cpu, cuda"), std::string::npos);
  EXPECT_EQ(parse_value("device", "cuda:3"), json("cuda:3"));
  EXPECT_NE(error_of([] { parse_value("lr", "-1"); }).find("finite number >= 0"), std::string::npos);
  EXPECT_NE(error_of([] { RunConfig::from_json(json{{"stepz", 1}}); }).find("unknown key 'stepz'"), std::string::npos);
  // Round trip through JSON keeps every field.
  RunConfig c;
  c.model = "gpt-tiny";
  c.batch_size = 3;
  c.lr = 0.25;
  c.eval = false;
  EXPECT_EQ(RunConfig::from_json(c.to_json()).to_json(), c.to_json());
}

TEST(Config, BuiltinSuitesParse) {
  for (const auto& name : builtin_suite_names()) {
    const Suite s = load_suite(name);
    EXPECT_EQ(s.name, name);
    EXPECT_FALSE(expand(s).empty()) << name;
  }
  const auto quick = expand(load_suite("quick"));
  ASSERT_EQ(quick.size(), 4u);
  const auto precision = expand(load_suite("precision"));
  const auto ckpt = expand(load_suite("checkpointing"));
  ASSERT_EQ(ckpt.size(), 16u);  // 2 models x 4 policies x 2 batch sizes
  EXPECT_EQ(ckpt[2].name, "gpt-tiny/ckpt-full/bs16");
  EXPECT_EQ(load_suite("checkpointing").frontier["budget"], "64MiB");
  const Suite pitfalls = load_suite("pitfalls");
  ASSERT_EQ(pitfalls.pitfalls.size(), 4u);  // one of each kind, in the issue's order
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(pitfalls.pitfalls[i]["kind"], pitfall_kinds()[i]);
  ASSERT_EQ(precision.size(), 17u);  // 2 models x 7 modes + 3 stress cells
  EXPECT_EQ(precision[4].name, "mlp/16-mixed-noscale");
  EXPECT_EQ(quick[0].name, "mlp/32-true");
  EXPECT_EQ(quick[3].name, "gpt-tiny/bf16-mixed");
}

// A suite of listed cells and no axes runs those cells alone: its base is what they start from.
TEST(Suite, ListedCellsWithoutAxesLeaveTheBaseOut) {
  const auto cells = expand(parse_suite("name='x'\n[base]\nmodel='gpt-tiny'\nsteps=3\n[[cells]]\nname='a'\nbatch_size=4\n"
                                        "[[cells]]\nname='b'\nmodel='mlp'\n", "c.toml"));
  ASSERT_EQ(cells.size(), 2u);
  EXPECT_EQ(cells[0].name, "a");
  EXPECT_EQ(cells[0].config.model, "gpt-tiny");
  EXPECT_EQ(cells[0].config.steps, 3);
  EXPECT_EQ(cells[1].config.model, "mlp");
  ASSERT_EQ(expand(parse_suite("name='x'\n[base]\nmodel='mlp'\n", "c.toml")).size(), 1u);  // no cells: the base is one
}

// Model shapes as data: a suite's own model by its dimensions, a preset's dimension overridden per cell,
// and every inconsistency a one-line error before anything runs.
TEST(ModelShapes, ASuiteDefinesItsOwnModelAndACellOverridesADimension) {
  const Suite s = parse_suite(R"(
name = "shapes"
[axes]
model = ["my-llama", "llama-tiny"]
[models.my-llama]
family = "llama"
layers = 3
d_model = 48
heads = 6
kv_heads = 2
ffn = 128
seq_len = 32
vocab = 300
tied = true
[[cells]]
name = "deeper"
model = "my-llama"
layers = 5
)", "shapes.toml");
  const auto cells = expand(s);
  ASSERT_EQ(cells.size(), 3u);
  EXPECT_EQ(cells[0].name, "my-llama");
  const ModelShape mine = resolve_model(cells[0].config);
  EXPECT_EQ(mine.family, "llama");
  EXPECT_EQ(mine.layers, 3);
  EXPECT_EQ(mine.head_dim(), 8);
  EXPECT_TRUE(mine.tied);
  EXPECT_DOUBLE_EQ(mine.rope_theta, 500000.0);  // the family's default where the table is silent
  // Counted by hand: embedding 300x48, per layer q 48x48, k and v 48x16, o 48x48, 3 x 48x128, 2 norms,
  // the final norm; the head is the embedding.
  const int64_t layer = 48 * 48 + 2 * 48 * 16 + 48 * 48 + 3 * 48 * 128 + 2 * 48;
  EXPECT_EQ(analytic_decoder_parameters(mine), 300 * 48 + 3 * layer + 48);
  EXPECT_EQ(resolve_model(cells[2].config).layers, 5);  // the cell's own setting beats the table
  EXPECT_EQ(resolve_model(cells[1].config).layers, 2);  // the preset is untouched

  Suite over = s;
  apply_override(over, "layers", json(4));  // --set layers=4: every cell
  for (const auto& c : expand(over)) EXPECT_EQ(resolve_model(c.config).layers, 4) << c.name;
  EXPECT_EQ(suite_to_json(s)["models"]["my-llama"]["kv_heads"], 2);
}

TEST(ModelShapes, InconsistentDimensionsAreOneLineErrors) {
  auto parse = [](const std::string& text) { return error_of([&] { parse_suite("name='x'\n" + text, "bad.toml"); }); };
  const std::string own = "[axes]\nmodel=['m']\n[models.m]\nfamily='llama'\nlayers=2\nffn=64\nseq_len=16\nvocab=256\n";
  EXPECT_NE(parse(own + "d_model=50\nheads=4\n").find("d_model 50 is not divisible by heads 4"), std::string::npos);
  EXPECT_NE(parse(own + "d_model=64\nheads=4\nkv_heads=3\n").find("heads 4 is not divisible by kv_heads 3"),
            std::string::npos);
  EXPECT_NE(parse(own + "d_model=60\nheads=4\n").find("head_dim 15 must be even"), std::string::npos);
  EXPECT_NE(parse(own + "heads=4\n").find("d_model must be given"), std::string::npos);
  EXPECT_NE(parse("[axes]\nmodel=['m']\n[models.m]\nfamily='mamba'\n").find("unknown family 'mamba'"), std::string::npos);
  EXPECT_NE(parse("[axes]\nmodel=['m']\n[models.m]\nlayers=2\n").find("needs its family"), std::string::npos);
  EXPECT_NE(parse("[models.m]\nfamily='llama'\nlr=1\n").find("not a model dimension"), std::string::npos);
  EXPECT_NE(parse("[models.gpt-tiny]\nfamily='gpt'\n").find("a preset's name"), std::string::npos);
  EXPECT_NE(parse("[axes]\nmodel=['nope']\n").find("unknown model 'nope'"), std::string::npos);
  EXPECT_NE(parse("[base]\nmodel='mlp'\nlayers=3\n").find("takes no dimension keys"), std::string::npos);
  EXPECT_NE(parse("[base]\nmodel='gpt-tiny'\nkv_heads=2\n").find("llama dimension"), std::string::npos);
  EXPECT_NE(parse("[base]\nmodel='llama-tiny'\nheads=3\n").find("not divisible by heads 3"), std::string::npos);
  EXPECT_NE(parse("[base]\nmodel='llama-tiny'\nfamily='gpt'\n").find("is a llama preset"), std::string::npos);
  // One line each.
  EXPECT_EQ(parse(own + "d_model=50\nheads=4\n").find('\n'), std::string::npos);
}
