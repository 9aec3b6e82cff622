"""A short text summary of Nsight Compute's SASS page, one block per kernel (gpu_check.sh's ncu step).

``ncu -i report.ncu-rep --page source --print-source sass`` prints every instruction of every
profiled kernel with its counters (megabytes for a flash kernel); this keeps what a comparison of
two kernels needs: the stall reasons' shares of the warp samples, the instruction mix, each kind of
memory instruction's shared-memory wavefronts and global sectors per executed instruction against
their ideal, and the hottest instructions with their main stall.

    python benchmarks/ncu_summary.py ncu-forward-sass.txt > ncu-forward-summary.txt
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

#: Memory opcodes whose wavefronts and sectors are tabled.
MEMORY_OPCODES = ("LDGSTS", "LDSM", "LDS", "STS", "LDG", "STG", "RED", "ATOM", "LDL", "STL")


def parse(text: str) -> dict[str, tuple[list[str], list[list[str]]]]:
    """Kernel name -> (column names, rows); a row is [address, instruction, counters...]."""
    lines = text.split("\n")
    starts = [index for index, line in enumerate(lines) if line.startswith("Kernel Name")]
    kernels = {}
    for number, start in enumerate(starts):
        end = starts[number + 1] if number + 1 < len(starts) else len(lines)
        rule = next(index for index in range(start, end) if lines[index].startswith("---"))
        spans = [(match.start(), match.end()) for match in re.finditer(r"-+", lines[rule])]
        first = next((index for index in range(rule, end) if lines[index].startswith("0x")), end)
        header = [line for line in lines[rule + 1 : first] if line.strip()]
        columns = [re.sub(r"\s+", "", "".join(line[a:b] for line in header)).lower() for a, b in spans]
        source = spans[1]
        rows = [
            [line[: source[0]].strip(), line[source[0] : source[1]].strip(), *line[source[1] :].split()]
            for line in lines[first:end]
            if line.startswith("0x")
        ]
        name = "".join(line[source[0] : source[1]].strip() for line in lines[start:rule])  # wrapped mid-word
        kernels[name] = (columns, rows)
    return kernels


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(instruction: str) -> str:
    words = instruction.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def summarize(name: str, columns: list[str], rows: list[list[str]], top: int) -> str:
    def column(title: str) -> int | None:
        """The column of that title (kernels without shared-memory traffic have no wavefront columns)."""
        return columns.index(title) if title in columns else None

    def value(row: list[str], index: int | None) -> float:
        return number(row[index]) if index is not None and index < len(row) else 0.0

    executed, samples = column("instructionsexecuted"), column("warpstallsampling(allsamples)")
    stalls = [index for index, title in enumerate(columns) if title.startswith("stall_") and "notissued" not in title]
    out = [f"== {name}", f"SASS instructions {len(rows)}, executed {sum(value(r, executed) for r in rows):,.0f}"]
    totals = {columns[index]: sum(value(r, index) for r in rows) for index in stalls}
    all_samples = sum(totals.values()) or 1.0
    shares = sorted(totals.items(), key=lambda item: -item[1])[:10]
    out.append("stalls (share of warp samples): " + ", ".join(f"{k[6:]} {v / all_samples:.1%}" for k, v in shares))
    mix: Counter[str] = Counter()
    for r in rows:
        mix[opcode(r[1])] += value(r, executed)
    total = sum(mix.values()) or 1.0
    out.append("instruction mix: " + ", ".join(f"{k} {v / total:.1%}" for k, v in mix.most_common(16)))
    counters = [executed] + [
        column(title)
        for title in ("l1wavefrontsshared", "l1wavefrontssharedideal", "l2theoreticalsectorsglobal",
                      "l2theoreticalsectorsglobalideal")
    ]
    memory: dict[str, list[float]] = defaultdict(lambda: [0.0] * 6)
    for r in rows:
        op = opcode(r[1])
        if op in MEMORY_OPCODES:
            entry = memory[op]
            entry[0] += 1
            for slot, index in enumerate(counters, start=1):
                entry[slot] += value(r, index)
    out.append("memory instructions: opcode, SASS lines, executed, shared wavefronts / ideal, global sectors / ideal (per executed)")
    for op, (lines_, count, waves, waves_ideal, secs, secs_ideal) in sorted(memory.items(), key=lambda i: -i[1][1]):
        per = max(count, 1.0)
        out.append(
            f"  {op:7} {lines_:6.0f} {count:14,.0f}   {waves / per:6.2f} / {waves_ideal / per:6.2f}"
            f"   {secs / per:6.2f} / {secs_ideal / per:6.2f}"
        )
    out.append(f"hottest {top} instructions: samples, main stall, instruction")
    for r in sorted(rows, key=lambda r: -value(r, samples))[:top]:
        main = max(stalls, key=lambda index: value(r, index))
        out.append(f"  {value(r, samples):8.0f}  {columns[main][6:]:16} {r[1]}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass_page", type=Path)
    parser.add_argument("--top", type=int, default=25)
    arguments = parser.parse_args(argv)
    kernels = parse(arguments.sass_page.read_text())
    print("\n\n".join(summarize(name, columns, rows, arguments.top) for name, (columns, rows) in kernels.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
