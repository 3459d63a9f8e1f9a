/* A build without the CUDA backend: --cuda has no device to run on. */
#include <stdio.h>

#include "fuzz.h"

int fz_cuda_init(fz_dev *dev);
int fz_cuda_properties(const fz_dev *dev, uint64_t seed, int verbose);

int fz_cuda_init(fz_dev *dev) {
  (void)dev;
  printf("fa_fuzz: this build has no CUDA backend (skipped)\n");
  return 0;
}

int fz_cuda_properties(const fz_dev *dev, uint64_t seed, int verbose) {
  (void)dev, (void)seed, (void)verbose;
  return 0;
}
