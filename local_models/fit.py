"""Fitting a generated model at build time until greedy decoding gives its targets, on whatever CPU builds it.

Two local models are fitted when they are made: `local:tiny-llama-tools` (local_models/tools_fit.py) and
`local:tiny-whisper` (local_models/whisper.py). A fit is done when every target token beats its best rival by
`min_margin` logits, so that vLLM's kernels, whose float32 arithmetic differs from PyTorch's in the last bits, decode
the same tokens. Both fits share this routine, which makes that outcome independent of the floating point of the
kernels torch picks (AVX-512 or AVX2, MKL's paths on AMD or Intel):

- **A margin objective.** Cross-entropy averaged over a sequence gives one contested token 1/100th of the push;
  a fit could sit with one token at -0.6 while the loss looked converged (seen on AVX-512: two answers that differ
  in one token, each winning the other's). A hinge on every token's margin pushes exactly the tokens that are short.
- **A schedule and restarts.** Warm-up, then cosine decay (a constant step oscillates around the end), gradient
  clipping (a spike no longer throws a fit back); a fit that has not converged restarts from the same initial
  weights with half the step, a few times.
- **One thread**, for the fit only: the same reductions on every machine, and no OpenMP stalls when engines busy
  the cores meanwhile.

What does not converge raises one `FitError` naming the model, the margins, the CPU capability and the command that
reproduces it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class FitError(RuntimeError):
    """A generated model did not fit; the message says which, how far it got, and how to reproduce it."""


@dataclass(frozen=True)
class Recipe:
    lr: float
    max_steps: int  # per attempt
    check_every: int = 10  # steps between margin checks
    warmup: int = 20
    attempts: int = 3  # each from the same initial weights, the step halved each time
    min_margin: float = 3.0  # logits: the fit is done when every target token wins by this much
    hinge: float = 3.5  # the margin the hinge pushes every token towards (a little past min_margin)
    hinge_weight: float = 1.0  # 0: cross-entropy alone
    clip: float | None = 1.0  # gradient norm (None: no clipping)

    def lr_at(self, step: int, lr: float) -> float:
        if step <= self.warmup:  # (warmup 0: none)
            return lr * step / self.warmup
        progress = (step - self.warmup) / max(1, self.max_steps - self.warmup)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def margins(logits: Any, targets: Any) -> Any:
    """Per position: target logit minus the best rival's; +inf where the target is -100 (not scored)."""
    import torch

    scored = targets >= 0
    safe = targets.clamp(min=0)[..., None]
    chosen = logits.gather(-1, safe)[..., 0]
    rivals = logits.scatter(-1, safe, float("-inf")).max(dim=-1).values
    return torch.where(scored, chosen - rivals, torch.inf)


def margin_loss(logits: Any, targets: Any, recipe: Recipe) -> Any:
    """Cross-entropy (mean per sequence, summed) plus the hinge of every scored token short of `recipe.hinge`."""
    import torch

    scored = targets >= 0
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-100, reduction="none")
    per_sequence = ce.sum(dim=1) / scored.sum(dim=1).clamp(min=1)
    short = torch.relu(recipe.hinge - margins(logits, targets).clamp(max=recipe.hinge))
    return per_sequence.sum() + recipe.hinge_weight * short.sum()


@contextmanager
def one_thread() -> Iterator[None]:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def capability() -> str:
    """The CPU kernel path torch runs here (`ATEN_CPU_CAPABILITY` forces another)."""
    import torch

    return f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}"


def fit(
    name: str,
    model: Any,
    loss: Callable[[int], Any],
    worst: Callable[[], float],
    recipe: Recipe,
    reproduce: str,
) -> dict[str, Any]:
    """Train `model` (float32, as saved) until `worst()`, the least margin over everything that must decode,
    reaches `recipe.min_margin`; what it took.

    `loss(step)` is the loss of one step (a minibatch's, or the whole set's) on the model as it is; `worst()` is
    evaluated without gradients. What is trained: every parameter that requires a gradient.
    """
    import torch

    started = time.monotonic()
    trainable = [p for p in model.parameters() if p.requires_grad]
    initial = [p.detach().clone() for p in trainable]
    margin = best = float("-inf")
    with one_thread():
        for attempt in range(recipe.attempts):
            lr = recipe.lr / 2**attempt
            with torch.no_grad():
                for p, p0 in zip(trainable, initial, strict=True):
                    p.copy_(p0)
            optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=0.0)
            for step in range(1, recipe.max_steps + 1):
                for group in optimizer.param_groups:
                    group["lr"] = recipe.lr_at(step, lr)
                optimizer.zero_grad()
                loss(step).backward()
                if recipe.clip is not None:
                    torch.nn.utils.clip_grad_norm_(trainable, recipe.clip)
                optimizer.step()
                if step % recipe.check_every and step != recipe.max_steps:
                    continue
                with torch.no_grad():
                    margin = worst()
                best = max(best, margin)
                log.info("%s fit: attempt %d, step %d, margin %.2f", name, attempt + 1, step, margin)
                if margin >= recipe.min_margin:
                    return {
                        "attempt": attempt + 1,
                        "steps": step,
                        "margin": round(margin, 2),
                        "seconds": round(time.monotonic() - started, 1),
                        "capability": capability(),
                    }
    forced = os.environ.get("ATEN_CPU_CAPABILITY")
    raise FitError(
        f"{name} did not fit: least margin {margin:.2f} at the end, {best:.2f} at best (needs {recipe.min_margin}), "
        f"after {recipe.attempts} attempts of {recipe.max_steps} steps ({capability()}). "
        f"Reproduce: {f'ATEN_CPU_CAPABILITY={forced} ' if forced else ''}{reproduce}"
    )
