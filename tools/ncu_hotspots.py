"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page:

    ncu -k regex:KERNEL --launch-count 1 --import-source no --section SourceCounters \\
        --section WarpStateStats -o /tmp/profile python3 tools/profile_case.py ...
    ncu -i /tmp/profile.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 tools/ncu_hotspots.py sass.csv [--top 20] [--context 3]

Prints each stall reason's share of all warp samples, then the instructions that hold the most
samples with their two main reasons and the instructions just before them: a sample is charged
to the instruction that waits, so what it waits for (a load, a barrier, a wgmma group) is
usually a few lines up. `tools/gpu_check.sh profile` runs all three steps.
"""
import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
REASON_PREFIX = "stall_"


def read_source_page(path):
    """(header, rows) of the CSV; its first line names the kernel, the second is the header."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    for index, line in enumerate(lines):
        if "Address" in line and "Source" in line and SAMPLES in line:
            return line, [row for row in lines[index + 1:] if len(row) == len(line)]
    sys.exit(f"ncu_hotspots: {path} has no source-page header with '{SAMPLES}' (was it written with "
             f"--page source --csv --print-source sass, from a report with the SourceCounters section?)")


def number(text):
    try:
        return float(text.replace(",", "")) if text else 0.0
    except ValueError:
        return 0.0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv")
    parser.add_argument("--top", type=int, default=20, help="hottest instructions shown")
    parser.add_argument("--context", type=int, default=3, help="instructions shown before each")
    args = parser.parse_args(argv)

    header, rows = read_source_page(args.csv)
    source, samples = header.index("Source"), header.index(SAMPLES)
    # The per-reason columns of all samples (not the "(Not Issued)" copies).
    reasons = [(name[len(REASON_PREFIX):], i) for i, name in enumerate(header)
               if name.startswith(REASON_PREFIX) and "(" not in name]
    total = sum(number(row[samples]) for row in rows)
    if total == 0:
        sys.exit("ncu_hotspots: no stall samples in the report")

    print(f"{len(rows)} instructions, {total:.0f} samples")
    by_reason = sorted(((sum(number(row[i]) for row in rows), name) for name, i in reasons), reverse=True)
    print("by reason: " + ", ".join(f"{name} {100 * value / total:.1f} %" for value, name in by_reason if value))

    def describe(index):
        row = rows[index]
        share = 100 * number(row[samples]) / total
        main = sorted(((number(row[i]), name) for name, i in reasons), reverse=True)[:2]
        why = ", ".join(f"{name} {100 * value / total:.1f}" for value, name in main if value)
        return f"{index:5d} {share:5.1f} %  {row[source].strip()[:90]}" + (f"   [{why}]" if why else "")

    hottest = sorted(range(len(rows)), key=lambda i: number(rows[i][samples]), reverse=True)[:args.top]
    for index in sorted(hottest):
        print()
        for before in range(max(0, index - args.context), index):
            print("      " + describe(before))
        print("  >>> " + describe(index))


if __name__ == "__main__":
    main()
