/* twin-shard: the sharding subcommands on their own (`twin plan`, `twin check --sharding`)
 * until the `twin` tool links them. */
#include <stdio.h>
#include <string.h>

#include "shard/cli.h"

int main(int argc, char **argv) {
  if (argc >= 2 && strcmp(argv[1], "plan") == 0) return tw_plan_main(argc - 1, argv + 1);
  if (argc >= 2 && strcmp(argv[1], "check") == 0) return tw_check_sharding_main(argc - 1, argv + 1);
  fprintf(stderr, "usage: twin-shard plan ... | twin-shard check --sharding ...\n");
  return 2;
}
