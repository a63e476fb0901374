"""The GPU checks (tests/gpu/check_*.py) only run where a GPU is lent; here each must at least start and
say why it cannot run (exit 77 and a SKIP line), so that an import or argument error shows up in CI."""

import glob
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

SCRIPTS = sorted(glob.glob(os.path.join(REPO, "tests", "gpu", "check_*.py")))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the checks would really run")
@pytest.mark.parametrize("script", SCRIPTS, ids=os.path.basename)
def test_gpu_check_skips_with_a_reason_without_cuda(script):
    result = subprocess.run([sys.executable, script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 77, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout.startswith("SKIP: "), result.stdout


def test_every_gpu_check_is_found():
    assert {os.path.basename(s) for s in SCRIPTS} >= {
        "check_epd.py",
        "check_megatron_main_job.py",
        "check_nccl_weights.py",
        "check_pd_disaggregation.py",
        "check_torch_cuda.py",
        "check_megatron_cuda.py",
    }


@pytest.mark.parametrize(
    ("script", "step"),
    [("check_torch_cuda.py", "resume from a sharded checkpoint"), ("check_megatron_cuda.py", "ZeRO-1 vs plain")],
)
def test_a_trainer_cuda_check_passes_with_the_cpu_standing_in(script, step):
    """The trainer-only CUDA checks, run with the CPU as the device (the Megatron one under the test shim): their
    own logic (the tolerances, the resume and sleep sequences, the export check) is exercised here, where no GPU
    ever is."""
    pytest.importorskip("megatron.core")
    path = os.path.join(REPO, "tests", "gpu", script)
    result = subprocess.run(
        [sys.executable, path, "--device", "cpu"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "PASS" in result.stdout and step in result.stdout
