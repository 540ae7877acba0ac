/* Sharding commands of the `twin` CLI (shard/). argv[0] is the subcommand; returns the exit
 * code. */
#ifndef TWIN_SHARD_CLI_H
#define TWIN_SHARD_CLI_H
#ifdef __cplusplus
extern "C" {
#endif
int tw_plan_main(int argc, char **argv);           /* twin plan --mesh ... --op ... */
int tw_check_sharding_main(int argc, char **argv); /* twin check --sharding */
#ifdef __cplusplus
}
#endif
#endif
