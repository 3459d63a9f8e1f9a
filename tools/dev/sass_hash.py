#!/usr/bin/env python3
"""Whether a change leaves the GPU kernels' machine code alone: one line per kernel of a
library (or object, or cubin), its name and an md5 of its SASS (cuobjdump -sass, addresses
and encodings left out; a name compiled for several architectures gets one hash each).
Run it on the build before and after a refactor and compare:

  python3 tools/dev/sass_hash.py build-gpu/libflashattn.so > before.txt
  ... rebuild ...
  python3 tools/dev/sass_hash.py build-gpu/libflashattn.so | diff before.txt - && echo same

cuobjdump comes with the CUDA toolkit; where the toolkit lacks it, PyPI's
nvidia-cuda-cuobjdump package has it (pip download nvidia-cuda-cuobjdump --no-deps, unzip,
nvidia/cu13/bin/cuobjdump): pass its path with --cuobjdump or put it on PATH.
"""
import argparse
import hashlib
import os
import re
import shutil
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("binary", help="shared library, object file or cubin")
    ap.add_argument("--cuobjdump", default=None, help="path of cuobjdump")
    a = ap.parse_args()
    tool = a.cuobjdump or shutil.which("cuobjdump")
    if not tool:
        cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
        tool = os.path.join(cuda, "bin", "cuobjdump")
    if not os.path.exists(tool):
        sys.exit("sass_hash: no cuobjdump (see --help for where to get one)")
    out = subprocess.run([tool, "-sass", a.binary], capture_output=True, text=True)
    if out.returncode:
        sys.exit("sass_hash: %s -sass %s: %s" % (tool, a.binary, out.stderr.strip()))
    hashes = {}
    for part in re.split(r"\n\s+Function : ", out.stdout)[1:]:
        name = part.split("\n", 1)[0].strip()
        code = "\n".join(re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", part))
        hashes.setdefault(name, []).append(hashlib.md5(code.encode()).hexdigest())
    if not hashes:
        sys.exit("sass_hash: no kernels in %s" % a.binary)
    for name in sorted(hashes):
        print(name, " ".join(sorted(hashes[name])))


if __name__ == "__main__":
    main()
