// trainscope ab, the pre-merge gate, end to end: it runs alone (RUN_SERIAL), since a gate that
// shares its two cores with other tests measures them, not the builds.
#include <gtest/gtest.h>

#include "cli_support.hpp"

namespace trainscope::test {
namespace {

// `trainscope ab` with the same binary on both sides: an injected 50% slowdown on the new side is a
// regression (exit 1); without it, no regression (pass or inconclusive). With 8 blocks and alpha 0.01
// a false alarm needs p <= 0.01, i.e. W+ >= 35 of 36 (every block slower, or all but the smallest):
// under the null P = 2/256 < 1%, and the effect must exceed 5% besides.
TEST(Gate, AbCatchesAnInjectedSlowdownAndPassesAnAaRun) {
  const std::string suite = write("gate_tiny.toml",
                                  "name = \"gate-tiny\"\ndescription = \"one short cell\"\n"
                                  "[base]\nseed = 0\neval = false\noverflow_every = 0\nwarmup_steps = 2\nsteps = 12\n"
                                  "batch_size = 8\n[axes]\nmodel = [\"gpt-tiny\"]\n");
  const std::string args = "ab --base " + bin() + " --new " + bin() + " --suite " + suite + " --blocks 8 --max-blocks 8 --alpha 0.01";
  const Result slow = ts(args + " --new-set inject=slow:50 --format json --out " + tmp("ab_slow"));
  EXPECT_EQ(slow.code, 1) << slow.out;
  const json s = read_json(tmp("ab_slow") + "/ab.json");
  EXPECT_EQ(s["verdict"], "regression");
  EXPECT_GT(s["cells"][0]["effect"].get<double>(), 0.05);
  EXPECT_EQ(s["blocks"], 8);
  // The decision uses the fastest step per side; the medians' ratio rides along, one per block too.
  EXPECT_EQ(s["cells"][0]["log_ratios"].size(), 8u);
  EXPECT_EQ(s["cells"][0]["p50_log_ratios"].size(), 8u);
  EXPECT_NE(s.value("design", "").find("fastest step"), std::string::npos);
  // 8 blocks at most: one look, so all of alpha at it.
  EXPECT_EQ(s["looks"], 1);
  EXPECT_DOUBLE_EQ(s["alpha_per_look"].get<double>(), 0.01);
  // The A/A run with one process per side per block (AB, then BA): 2 slots per block, half the time.
  const Result same = ts(args + " --per-side 1 --out " + tmp("ab_same"));
  EXPECT_NE(same.code, 1) << same.out;
  EXPECT_TRUE(same.code == 0 || same.code == 3) << same.out;
  const json aa = read_json(tmp("ab_same") + "/ab.json");
  EXPECT_EQ(aa["per_side"], 1);
  EXPECT_EQ(aa["slots"].size(), 2 * aa["blocks"].get<size_t>());
  EXPECT_EQ(aa["slots"][0]["side"], "base");  // block 0: AB; block 1: BA
  EXPECT_EQ(aa["slots"][2]["side"], "new");
  EXPECT_EQ(s["slots"].size(), 4 * s["blocks"].get<size_t>());  // the default: ABBA
  // Bad input: one line, exit 2.
  for (const std::string& bad : {"ab --base /nonexistent --new " + bin(), "ab --base /bin/true --new " + bin(),
                                "ab --base " + bin() + " --new " + bin() + " --min-effect 120%",
                                // a setting one side refuses: bad input, and ab.json says where it stopped
                                args + " --new-set precision=fp4 --out " + tmp("ab_bad")}) {
    const Result r = ts(bad);
    EXPECT_EQ(r.code, 2) << bad << ": " << r.out;
    EXPECT_EQ(lines(r.out), 1) << bad << ": " << r.out;
  }
  EXPECT_EQ(read_json(tmp("ab_bad") + "/ab.json")["verdict"], "error");
}

}  // namespace
}  // namespace trainscope::test
