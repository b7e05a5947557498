#include "runners/commands/cli.hpp"

int main(int argc, char** argv) { return trainscope::runners::cli_main(argc, argv); }
