"""``python -m flashattn_ext``: a report of the environment and of this build."""

from __future__ import annotations

import platform
import sys

import torch


def _op_kernels(op_name: str) -> str:
    """The dispatch keys among CPU/CUDA/Meta with a kernel for the op."""
    keys = [key for key in ("CPU", "CUDA", "Meta")
            if torch._C._dispatch_has_kernel_for_dispatch_key(f"flashattn_ext::{op_name}", key)]
    return ", ".join(keys) if keys else "none"


def environment_report() -> str:
    import flashattn_ext
    from flashattn_ext import ops

    info = flashattn_ext.build_info()
    lines = [
        f"flashattn_ext {flashattn_ext.__version__} ({flashattn_ext.__file__})",
        f"python {platform.python_version()} on {platform.platform()}",
        f"torch (runtime) {torch.__version__}, CUDA runtime {torch.version.cuda or 'none'}",
        f"built against torch {info['torch_version']}, "
        f"CUDA {info['cuda_version'] or 'none (CPU-only build)'}",
        f"compiled CUDA archs: {info['cuda_archs'] or 'none'}",
        f"compiled head-dim tiles: {info['head_dim_tiles'] or 'none'}",
        f"CUDA kernels in this build: {info['cuda_kernels']}",
    ]
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            lines.append(f"GPU {index}: {torch.cuda.get_device_name(index)}, "
                         f"compute capability {major}.{minor}")
    else:
        lines.append("GPU: no CUDA device")
    for op_name in ("attention_forward", "attention_backward", "attention_kvcache_forward"):
        has_cuda = "yes" if ops.has_kernel(op_name, "CUDA") else "no"
        lines.append(f"op flashattn_ext::{op_name}: CUDA kernel {has_cuda} "
                     f"(kernels for {_op_kernels(op_name)})")
    return "\n".join(lines)


def main() -> int:
    print(environment_report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
