#pragma once
// The `trainscope` command line (CLI11): run | list | env | report, and the hidden _cell.
namespace trainscope::runners {

// Exit codes: 0 success, 1 a cell failed (run), 2 bad arguments or input, 130 interrupted.
int cli_main(int argc, char** argv);

}  // namespace trainscope::runners
