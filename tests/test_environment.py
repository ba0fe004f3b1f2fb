"""`python -m flashattn_ext` and the build metadata."""

import subprocess
import sys

import torch

import flashattn_ext


def test_environment_report(tmp_path):
    # From an empty directory, so the report comes from the installed package.
    result = subprocess.run([sys.executable, "-m", "flashattn_ext"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = result.stdout
    info = flashattn_ext.build_info()
    assert f"flashattn_ext {flashattn_ext.__version__}" in report
    assert f"torch (runtime) {torch.__version__}" in report
    assert f"built against torch {info['torch_version']}" in report
    assert f"CUDA kernels in this build: {info['cuda_kernels']}" in report
    assert "compiled CUDA archs:" in report and "compiled head-dim tiles:" in report
    for op_name in ("attention_forward", "attention_backward"):
        assert f"op flashattn_ext::{op_name}: CUDA kernel " in report
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        assert torch.cuda.get_device_name(0) in report and f"compute capability {major}.{minor}" in report
    else:
        assert "GPU: no CUDA device" in report


def test_cuda_kernel_flags_agree_with_build_info():
    built_with_cuda = flashattn_ext.build_info()["cuda_kernels"] == "yes"
    assert flashattn_ext.ops.HAS_CUDA_KERNELS == built_with_cuda
