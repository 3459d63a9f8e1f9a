"""examples/ keep running: a few steps of the GPT-2 example on the CPU."""
import json
import os
import subprocess
import sys

import pytest

from conftest import needs_torch

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "gpt2_train.py")


@needs_torch
def test_gpt2_example_runs(tmp_path):
    if not os.path.exists(EXAMPLE):
        pytest.skip("examples/ not found")
    out = tmp_path / "res.json"
    cmd = [sys.executable, EXAMPLE, "--n-layer", "1", "--n-head", "2", "--n-embd", "32",
           "--seqlen", "48", "--steps", "3", "--batch", "2", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in results] == ["flashattn", "math"]
    a, b = (r["losses"] for r in results)
    assert len(a) == 3 and max(abs(x - y) for x, y in zip(a, b)) < 1e-4


TRANSFORMERS_EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples",
                                    "transformers_train.py")


@needs_torch
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_transformers_example_runs(tmp_path, model):
    pytest.importorskip("transformers")
    out = tmp_path / "res.json"
    cmd = [sys.executable, TRANSFORMERS_EXAMPLE, "--model", model, "--steps", "3",
           "--gen-tokens", "4", "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads(out.read_text())["results"]
    assert [r["impl"] for r in results] == ["flashattn", "sdpa"]
    a, b = results
    assert max(abs(x - y) for x, y in zip(a["losses"], b["losses"])) < 1e-4
    assert a["generated"] == b["generated"]
