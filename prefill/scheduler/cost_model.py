"""Latency models of the two ways to give KV blocks back, profiled on the machine that serves.

Recompute costs a prefill of the evicted tokens when their owner resumes; swap costs a copy of their blocks
to the host pool and one back. Each is a quadratic fit of measured latency (seconds) against size (tokens
for recompute, blocks for a swap direction), as Stream2LLM fits its profiles; `cost` eviction compares the
two for each victim. `python -m prefill.scheduler.profile` measures and saves them; replicas load the file
(`prefill.scheduler.cost_model`) or profile themselves at start-up.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Fit:
    """latency(x) = a·x² + b·x + c, from (x, seconds) samples."""

    coeffs: list[float]
    samples: dict[int, list[float]] = field(default_factory=dict)

    @classmethod
    def of(cls, samples: dict[int, list[float]]) -> Fit:
        xs = [x for x, ys in samples.items() for _ in ys]
        ys = [y for ys in samples.values() for y in ys]
        degree = min(2, len(set(xs)) - 1)
        coeffs = list(np.polyfit(xs, ys, degree)) if degree >= 0 else [0.0]
        return cls([0.0] * (3 - len(coeffs)) + [float(c) for c in coeffs], samples)

    def __call__(self, x: float) -> float:
        a, b, c = self.coeffs
        return max(0.0, a * x * x + b * x + c)


@dataclass
class LatencyModel:
    recompute: Fit  # tokens -> s
    swap_out: Fit  # blocks -> s
    swap_in: Fit  # blocks -> s
    metadata: dict[str, Any] = field(default_factory=dict)

    def prefer_swap(self, tokens: int, blocks: int) -> bool:
        """Whether copying `blocks` out and back is cheaper than prefilling `tokens` again."""
        return self.swap_out(blocks) + self.swap_in(blocks) < self.recompute(tokens)

    def to_json(self) -> dict[str, Any]:
        return {
            name: {"coeffs": fit.coeffs, "samples": {str(k): v for k, v in fit.samples.items()}}
            for name, fit in (("recompute", self.recompute), ("swap_out", self.swap_out), ("swap_in", self.swap_in))
        } | {"metadata": self.metadata}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LatencyModel:
        def fit(name: str) -> Fit:
            samples = {int(k): v for k, v in data[name].get("samples", {}).items()}
            return Fit(list(data[name]["coeffs"]), samples)

        return cls(fit("recompute"), fit("swap_out"), fit("swap_in"), data.get("metadata", {}))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> LatencyModel:
        return cls.from_json(json.loads(Path(path).read_text()))
