"""The long run without hypothesis: ``python -m padless.testing.fuzz --examples 5000 --seed 0``
draws cases from :class:`random.Random` (case ``k`` from seed ``seed + k``, so any case is
reproduced alone with ``--seed S --examples 1``), judges each, and prints a summary table:
steps drawn per family, outcomes per family (a failure counts against the family of the step
it is attributed to), the known entries hit, and every unexplained failure with its case."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import random
import sys
import time

import torch

from padless.testing.fuzz.core import RandomChooser
from padless.testing.fuzz.draw import FAMILIES, draw_case
from padless.testing.fuzz.run import Verdict, judge

STATUSES = ("pass", "refused", "lenient", "gap", "wrong", "error")


@dataclasses.dataclass
class Tally:
    """Counts over many cases (the fast test and the sweep share it)."""

    examples: int = 0
    steps: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    modes: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    outcomes: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # (family, status, known?)
    known: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    unexplained: list = dataclasses.field(default_factory=list)

    def add(self, case, v: Verdict, label: str = "") -> None:
        self.examples += 1
        self.modes[case.mode + ("+wrt" if case.wrt is not None else "")] += 1
        for s in case.steps:
            self.steps[s.family] += 1
        fam = case.steps[v.step].family if v.step is not None and v.step < len(case.steps) else "-"
        self.outcomes[(fam, v.status, v.known is not None)] += 1
        if v.known is not None:
            self.known[v.known.split(":", 1)[0]] += 1
        elif not v.ok:
            self.unexplained.append((label, case, v))

    def table(self) -> str:
        lines = [f"examples: {self.examples}   modes: " + ", ".join(f"{m} {n}" for m, n in sorted(self.modes.items()))]
        head = f"{'family':<13}{'steps':>7}" + "".join(f"{s:>9}" for s in STATUSES) + f"{'known':>8}"
        lines += [head, "-" * len(head)]
        fams = list(FAMILIES) + ["-"]
        total = collections.Counter()
        for f in fams:
            row = {s: sum(n for (ff, st, _), n in self.outcomes.items() if ff == f and st == s) for s in STATUSES}
            kn = sum(n for (ff, _, k), n in self.outcomes.items() if ff == f and k)
            total.update(row)
            total["known"] += kn
            if f == "-" and not any(row.values()):
                continue
            lines.append(f"{f:<13}{self.steps.get(f, 0):>7}" + "".join(f"{row[s]:>9}" for s in STATUSES) + f"{kn:>8}")
        lines.append(f"{'all':<13}{sum(self.steps.values()):>7}" + "".join(f"{total[s]:>9}" for s in STATUSES)
                     + f"{total['known']:>8}")
        lines.append("(a case's outcome counts against the family of the step it is attributed to; 'pass' "
                     "against '-'; known = gaps/wrong/errors a KNOWN_BUGS or KNOWN_GAPS entry excuses)")
        if self.known:
            lines.append("known entries hit: " + ", ".join(f"{k} {n}" for k, n in sorted(self.known.items())))
        gaps = sum(n for (_, st, _), n in self.outcomes.items() if st == "gap")
        lines.append(f"refusals: {total['refused']} where a sample alone raises too (correct), {gaps} gaps "
                     f"(code with one per-sample meaning refused), {total['known']} excused by known entries")
        lines.append(f"unexplained failures: {len(self.unexplained)}")
        return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m padless.testing.fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", default=None, help="comma-separated families to favour (targeted draws)")
    ap.add_argument("--show", type=int, default=10, help="unexplained failures to print in full")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    fams = args.families.split(",") if args.families else None
    tally = Tally()
    t0 = time.perf_counter()
    for k in range(args.examples):
        seed = args.seed + k
        case = draw_case(RandomChooser(random.Random(seed)), families=fams)
        tally.add(case, judge(case), label=f"seed {seed}")
    print(tally.table())
    print(f"({time.perf_counter() - t0:.0f} s)")
    for label, case, v in tally.unexplained[: args.show]:
        print(f"\n[{label}] {v.status} {case!r}\n  {v.detail[:800]}")
    return 1 if tally.unexplained else 0


if __name__ == "__main__":
    sys.exit(main())
