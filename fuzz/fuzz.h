/* `twin fuzz`: differential fuzzing of every operation against the oracle (fuzz/). */
#ifndef TWIN_FUZZ_FUZZ_H
#define TWIN_FUZZ_FUZZ_H
#ifdef __cplusplus
extern "C" {
#endif
/* argv[0] is "fuzz"; returns the process exit code. */
int tw_fuzz_main(int argc, char **argv);
#ifdef __cplusplus
}
#endif
#endif
