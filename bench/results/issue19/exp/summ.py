import collections
import sys
from pathlib import Path


def summ(path, top=30):
    self_, incl = collections.Counter(), collections.Counter()
    total = 0
    for line in Path(path).read_text().splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        n = int(n)
        total += n
        frames = stack.split(";")
        self_[frames[-1]] += n
        for f in set(frames):
            incl[f] += n
    print(f"== {path}: {total} samples")
    print("-- self")
    [print(f"{c / total * 100:5.1f}% {f[:150]}") for f, c in self_.most_common(top)]
    print("-- inclusive")
    [print(f"{c / total * 100:5.1f}% {f[:150]}") for f, c in incl.most_common(top + 25)]


for p in sys.argv[1:]:
    summ(p)
