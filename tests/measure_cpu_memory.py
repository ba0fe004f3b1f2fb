"""Peak memory of the CPU forward + backward against sequence length (not a test).

    python tests/measure_cpu_memory.py [--seqlens 2048 4096 8192] [--nheads 2] [--head-dim 64]

Each size runs in a fresh subprocess, so one size's allocations (and the
allocator's cached pages) cannot hide another's. In the child: the inputs are
allocated and a tiny warm-up call loads every code path; then the peak RSS is
reset (Linux: writing 5 to /proc/self/clear_refs resets VmHWM) and one
flash_attn_func forward + backward runs. Printed per size:

* peak growth: peak RSS during forward + backward minus RSS before it;
* outputs: the bytes of out, lse, dq, dk, dv, which any implementation must hold;
* working memory: growth minus outputs, i.e. what the algorithm itself used;
* S matrix: the bytes one fp32 seqlen x seqlen score matrix per (batch, head)
  would take, what a materialising implementation would need at the least.

Linear memory shows as outputs and working memory doubling with the seqlen
(working memory may also be near-constant: per-thread block scratch), while
the S matrix column quadruples.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
import flashattn_ext

seqlen, nheads, head_dim, causal = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"


def status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field + " not in /proc/self/status")


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


gen = torch.Generator().manual_seed(0)
q, k, v, dout = (torch.randn(1, seqlen, nheads, head_dim, generator=gen) for _ in range(4))
for t in (q, k, v):
    t.requires_grad_(True)

# Warm-up on a tiny problem: loads libraries and creates the thread pool.
small = [t.detach()[:, :64].clone().requires_grad_(True) for t in (q, k, v)]
torch.autograd.grad(flashattn_ext.flash_attn_func(*small, causal=causal), small, dout[:, :64])

rss_before = status_kib("VmRSS")
reset_peak()
start = time.perf_counter()
out, lse, _ = flashattn_ext.flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
seconds = time.perf_counter() - start
peak = status_kib("VmHWM")
outputs = sum(t.numel() * t.element_size() for t in (out, lse, dq, dk, dv))
print(json.dumps(dict(seqlen=seqlen, rss_before_kib=rss_before, peak_kib=peak, outputs_bytes=outputs,
                      seconds=seconds, threads=torch.get_num_threads())))
"""


def measure(seqlen: int, nheads: int, head_dim: int, causal: bool) -> dict:
    result = subprocess.run([sys.executable, "-c", CHILD, str(seqlen), str(nheads), str(head_dim),
                             "1" if causal else "0"], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--nheads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    args = parser.parse_args()

    mib = 1024.0 * 1024.0
    print(f"CPU forward + backward, fp32, batch 1, nheads {args.nheads}, head_dim {args.head_dim}, "
          f"causal {args.causal}; one fresh process per size")
    print(f"{'seqlen':>7} {'peak growth MiB':>16} {'outputs MiB':>12} {'working MiB':>12} "
          f"{'S matrix MiB':>13} {'time s':>7}")
    for seqlen in args.seqlens:
        r = measure(seqlen, args.nheads, args.head_dim, args.causal)
        growth = (r["peak_kib"] - r["rss_before_kib"]) * 1024.0
        working = growth - r["outputs_bytes"]
        s_matrix = args.nheads * seqlen * seqlen * 4
        print(f"{seqlen:>7} {growth / mib:>16.1f} {r['outputs_bytes'] / mib:>12.1f} {working / mib:>12.1f} "
              f"{s_matrix / mib:>13.1f} {r['seconds']:>7.2f}   ({r['threads']} threads)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
