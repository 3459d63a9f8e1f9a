/* test_flashattn: every CPU test case, run by the runner (runner.c):
 *
 *   test_flashattn [--quick] [-v] [--time] [--list] [--mutate-scale=X] [FILTER] */
#include "util.h"

int main(int argc, char **argv) {
  register_validation_tests();
  register_forward_tests();
  register_backward_tests();
  register_extension_tests();
  register_kvcache_tests();
  register_shard_tests();
  register_ring_tests();
  return tr_main(argc, argv);
}
