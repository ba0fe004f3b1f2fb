"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page:

    ncu -k regex:KERNEL --launch-count 1 --import-source no --section SourceCounters \\
        --section WarpStateStats -o /tmp/profile python3 tools/profile_case.py ...
    ncu -i /tmp/profile.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 tools/ncu_hotspots.py sass.csv [--top 20] [--context 3] [--regions 1.5]

Prints each stall reason's share of all warp samples, then the instructions that hold the most
samples with their two main reasons and the instructions just before them: a sample is charged
to the instruction that waits, so what it waits for (a load, a barrier, a wgmma group) is
usually a few lines up. `tools/gpu_check.sh profile` runs all three steps.

--regions P prints where the samples fall by how often the code ran instead (the report needs
the "Instructions Executed" column): the share of each execution count (per tile, per key
block, ...: a count is a place in the kernel's loop nest), then the runs of consecutive
instructions that ran equally often and hold at least P % of the samples.
"""
import argparse
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
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
    parser.add_argument("--regions", type=float, metavar="PERCENT",
                        help="samples by execution count, and the runs of equal count holding PERCENT or more")
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
    if args.regions is not None:
        print_regions(header, rows, source, samples, total, args.regions)
        return
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


def print_regions(header, rows, source, samples, total, min_percent):
    if EXECUTED not in header:
        sys.exit(f"ncu_hotspots: --regions needs the '{EXECUTED}' column (the SourceCounters section)")
    executed = header.index(EXECUTED)
    runs = []  # [first, last, count, samples]
    for index, row in enumerate(rows):
        count = number(row[executed])
        if runs and runs[-1][2] == count:
            runs[-1][1] = index
            runs[-1][3] += number(row[samples])
        else:
            runs.append([index, index, count, number(row[samples])])
    by_count = {}
    for first, last, count, held in runs:
        instructions, share = by_count.get(count, (0, 0.0))
        by_count[count] = (instructions + last - first + 1, share + held)
    print("by execution count:")
    for count, (instructions, held) in sorted(by_count.items(), key=lambda item: -item[1][1]):
        if 100 * held / total >= min_percent:
            print(f"  {count:12.0f} x {instructions:5d} instructions {100 * held / total:5.1f} %")
    print(f"runs of equal count with {min_percent} % or more:")
    for first, last, count, held in runs:
        if 100 * held / total >= min_percent:
            print(f"  {first:5d}-{last:5d} {count:12.0f} x {last - first + 1:5d} instructions "
                  f"{100 * held / total:5.1f} %  from {rows[first][source].strip()[:60]}")


if __name__ == "__main__":
    main()
