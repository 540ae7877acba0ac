/* Standalone `twin fuzz` (the `twin` CLI dispatches its fuzz subcommand to the same code). */
#include "fuzz/fuzz.h"

int main(int argc, char **argv) { return tw_fuzz_main(argc, argv); }
