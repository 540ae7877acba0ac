/* `twin plan --op router|ep_dispatch|ep_combine` (shard/ep_cli.c); tw_plan_main hands these
 * ops over. argv[0] is the subcommand; returns the exit code. */
#ifndef TWIN_SHARD_EP_CLI_H
#define TWIN_SHARD_EP_CLI_H
int tw_ep_plan_main(int argc, char **argv);
/* 1 if argv names one of these ops with --op. */
int tw_ep_plan_wants(int argc, char **argv);
#endif
