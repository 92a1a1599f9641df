"""Synthetic Stream2LLM-like workload traces (see ../shared/notes/stream2llm.md, sections 2 and 3).

The paper's traces (web crawler = "append mode", ANN vector search = "update mode") are not public text we can
replay here, so this module draws traces with the same shapes: Poisson arrivals, chunk counts, heavy-tailed gaps
between chunks and heavy-tailed prompt sizes, scaled down to a 4096-token model. Every query's text is its own
random English-looking filler, so no two queries share a prefix beyond the common template (a prefix cache cannot
help across queries), while an update-mode query's successive versions share a long ranked-document prefix (which
the server's longest-common-prefix invalidation exploits).

CLI: python bench/workloads.py append --queries 20 --qps 0.5 --out /tmp/x.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TEMPLATE = (
    "Answer the question based only on the provided context. "
    'If the answer is not in the context, say "I don\'t know."\nContext:\n'
)
QUESTION_PREFIX = "\n\nQuestion: "
TOKENS_PER_WORD = 1.3  # the estimate used when no tokenizer is given

# Shape parameters per workload. Times are in seconds before delay_multiplier; "tokens_sigma" keeps the paper's
# P95/P50 ratio of prompt sizes when the median is scaled down.
SHAPES: dict[str, dict[str, Any]] = {
    "append": {
        "chunks_mu": 8.0,  # total chunks (search result + pages): round(gauss(mu, sd)), clipped
        "chunks_sd": 3.0,
        "chunks_min": 2,
        "chunks_max": 17,
        "first_median_s": 1.0,  # the search result
        "first_sigma": 0.5,
        "gap_median_s": 0.70,  # median 0.70, mean 1.05, P95 3.08 like the paper's crawler
        "gap_sigma": 0.90,
        "tokens_sigma": math.log(28372 / 5749) / 1.645,
        "search_frac": (0.05, 0.10),  # the search result's share of the body
    },
    "update": {
        "chunks_median": 4.0,  # versions: round(lognormal(median, sigma)), clipped; mean ~4.5 like the paper's 4.42
        "chunks_sigma": 0.5,
        "chunks_min": 2,
        "chunks_max": 26,
        "first_median_s": 3.0,  # the first candidate set (the paper: collection time P50 3.9 s, P95 8.5 s)
        "first_sigma": 0.6,
        "gap_median_s": 0.0367,  # median 36.7 ms, P95 699 ms like the paper's ANNS traces
        "gap_sigma": math.log(0.699 / 0.0367) / 1.645,
        "tokens_sigma": math.log(30618 / 10126) / 1.645,
        "doc_tokens": (150, 400),  # per candidate document
        "keep_frac": (0.4, 0.9),  # the stable top of the ranked list kept by each new version
    },
}
SHAPES["pressure"] = SHAPES["append"]  # pressure = append with a delay multiplier

# The paper's published statistics (notes, sections 2-3), under the same keys as Trace.stats().
PAPER: dict[str, dict[str, Any]] = {
    "append": {
        "source": "crawler (SimpleQA), n=4,309; Llama-3.1-8B tokens",
        "tokens_mean": 8889,
        "tokens_p50": 5749,
        "tokens_p95": 28372,
        "chunks_mean": 7.86,
        "chunks_median": 8,
        "chunks_min": 1,
        "chunks_max": 17,
        "gap_p50_s": 0.7007,
        "gap_mean_s": 1.053,
        "gap_p95_s": 3.078,
        "gap_max_s": 34.9,
        "collect_mean_s": 9.22,
        "collect_p50_s": 8.67,
        "collect_p95_s": 16.4,
    },
    "update": {
        "source": "ANNS; chunks/gaps over 4,997 queries, tokens/collection over the 500-query subset",
        "tokens_mean": 13006,
        "tokens_p50": 10126,
        "tokens_p95": 30618,
        "chunks_mean": 4.42,
        "chunks_median": 4,
        "chunks_min": 1,
        "chunks_max": 26,
        "gap_p50_s": 0.0367,
        "gap_p95_s": 0.699,
        "gap_max_s": 9.0,
        "collect_mean_s": 4.47,  # 3.63 over all 4,997
        "collect_p50_s": 3.90,
        "collect_p95_s": 8.51,
    },
}
# The paper's pressure runs are the crawler with 10x page gaps (crawler delay_10 at QPS 4): its time figures x10.
PAPER["pressure"] = {
    k: (v * 10 if k.startswith(("gap_", "collect_")) else v) for k, v in PAPER["append"].items() if k != "source"
} | {"source": "crawler delay_10: the crawler's times x10 (derived, not published)"}

_WORDS_TEXT = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "one you were her all she there would their we him been has when who will more no if out so said what up its "
    "about into than them can only other new some could time these two may then do first any my now such like our "
    "over man me even most made after also did many before must through back years where much your way well down "
    "should because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year off come "
    "since against go came right used take three states himself few house use during without again place american "
    "around however home small found thought went say part once general high upon school every does got united left "
    "number course war until always away something fact though water less public put think almost hand enough far "
    "took head yet government system better set told nothing night end why called didn eyes find going look asked "
    "later knew point next program city business give group toward young days let room president side social given "
    "present several order national possible rather second face per among form important often things looked early "
    "white case john become large big need four within felt along children saw best church ever least power "
    "development light thing seemed family interest want members mind country area others done turned although open "
    "god service problem certain kind different thus began door help sense means whole matter perhaps itself york "
    "times law human line above name example action company hands local show whether five history gave today either "
    "act feet across taken past quite anything seen having death experience body word half really week field car "
    "words already themselves information tell together college shall money period held keep sure probably free "
    "seems real behind cannot political air question making office brought whose special heard major problems ago "
    "became federal moment study available known result street economic boy position reason change south board "
    "individual job areas society west close turn love community true court force full seem am wife age policy "
    "voice further center woman type private control research river market record library museum island bridge "
    "season album film novel team league station village county network energy science"
)
_WORDS = _WORDS_TEXT.split()
_WH = ["What", "Which", "Who", "When", "Where", "How many", "In which year did", "What is the name of"]


@dataclass
class Chunk:
    at_s: float  # when this input becomes available, seconds after the query's arrival
    text: str  # append: the text to append; replace: the WHOLE new input
    mode: str  # "append" | "replace"


@dataclass
class Query:
    id: int
    arrival_s: float  # seconds after the replay starts
    chunks: list[Chunk]  # in order; the last one completes the input (it carries the question)
    prompt_tokens: int | None  # tokens of the final input (None without a tokenizer)
    invalidated_tokens: int | None = None  # update: tokens past the common prefix, summed over updates

    @property
    def final_text(self) -> str:
        if self.chunks[-1].mode == "replace":
            return self.chunks[-1].text
        return "".join(c.text for c in self.chunks)

    @property
    def ready_s(self) -> float:
        return self.arrival_s + self.chunks[-1].at_s


@dataclass
class Trace:
    kind: str  # "append" | "update" | "pressure" | anything the caller names it
    seed: int
    qps: float
    delay_multiplier: float
    queries: list[Query]
    params: dict[str, Any] = field(default_factory=dict)  # every generation parameter, for provenance

    def save(self, path: Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: Path) -> Trace:
        d = json.loads(Path(path).read_text())
        queries = [
            Query(
                id=q["id"],
                arrival_s=q["arrival_s"],
                chunks=[Chunk(**c) for c in q["chunks"]],
                prompt_tokens=q["prompt_tokens"],
                invalidated_tokens=q.get("invalidated_tokens"),
            )
            for q in d["queries"]
        ]
        return cls(d["kind"], d["seed"], d["qps"], d["delay_multiplier"], queries, d.get("params", {}))

    def stats(self) -> dict[str, Any]:
        qs = self.queries
        out: dict[str, Any] = {"kind": self.kind, "queries": len(qs), "qps": self.qps}
        out["delay_multiplier"] = self.delay_multiplier
        if len(qs) > 1:
            out["interarrival_mean_s"] = (qs[-1].arrival_s - qs[0].arrival_s) / (len(qs) - 1)
        tokens = [q.prompt_tokens for q in qs if q.prompt_tokens is not None]
        if tokens:
            out |= {
                "tokens_mean": _mean(tokens),
                "tokens_p50": percentile(tokens, 50),
                "tokens_p95": percentile(tokens, 95),
            }
        counts = [len(q.chunks) for q in qs]
        if counts:
            out |= {"chunks_mean": _mean(counts), "chunks_median": percentile(counts, 50)}
            out |= {"chunks_min": min(counts), "chunks_max": max(counts)}
        gaps = [b.at_s - a.at_s for q in qs for a, b in zip(q.chunks, q.chunks[1:], strict=False)]
        if gaps:
            out |= {"gap_p50_s": percentile(gaps, 50), "gap_mean_s": _mean(gaps), "gap_p95_s": percentile(gaps, 95)}
            out["gap_max_s"] = max(gaps)
        collect = [q.ready_s - q.arrival_s for q in qs]
        if collect:
            out |= {"collect_mean_s": _mean(collect), "collect_p50_s": percentile(collect, 50)}
            out |= {"collect_p95_s": percentile(collect, 95), "duration_s": max(q.ready_s for q in qs)}
        inval = [q.invalidated_tokens for q in qs if q.invalidated_tokens is not None]
        if inval:
            out |= {"invalidated_total": sum(inval), "invalidated_mean": _mean(inval)}
        return out


def _mean(xs: list[float] | list[int]) -> float:
    return sum(xs) / len(xs)


def percentile(xs: list[float] | list[int], p: float) -> float:
    """Percentile with linear interpolation (numpy's default); the bench's one percentile."""
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def token_counter(tokenizer: str) -> Callable[[str], int]:
    """Counts the tokens of a text with a Hugging Face tokenizer (a path or a name), as prompts are counted."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


def estimate_tokens(text: str) -> int:
    return round(len(text.split()) * TOKENS_PER_WORD)


class _Words:
    """An endless, seeded stream of sentence-shaped filler words; take(n) is prefix-stable (the first n words
    never depend on n), so a query can be rebuilt at another size with the same text."""

    def __init__(self, seed: str) -> None:
        self._rng = random.Random(seed)
        self._words: list[str] = []

    def take(self, n: int) -> list[str]:
        while len(self._words) < n:
            sentence = [self._rng.choice(_WORDS) for _ in range(self._rng.randint(6, 16))]
            sentence[0] = sentence[0].capitalize()
            if len(sentence) > 9 and self._rng.random() < 0.4:
                sentence[self._rng.randint(3, len(sentence) - 4)] += ","
            sentence[-1] += "."
            self._words += sentence
        return self._words[:n]

    def text(self, n: int) -> str:
        """The first `n` words, ending as a sentence even when cut short."""
        words = self.take(n)
        return " ".join(words).rstrip(",") + ("" if words[-1].endswith(".") else ".")


def _question(rng: random.Random) -> str:
    return f"{rng.choice(_WH)} {' '.join(rng.choice(_WORDS) for _ in range(rng.randint(5, 10)))}?"


def _split(total: int, weights: list[float], floor: int) -> list[int]:
    """`total` words shared in proportion to `weights`, each at least `floor`; sums to max(total, floor*n)."""
    n = len(weights)
    spare = max(0, total - floor * n)
    acc, cuts, s = 0.0, [0], sum(weights)
    for w in weights:
        acc += w
        cuts.append(round(spare * acc / s))
    return [floor + b - a for a, b in zip(cuts, cuts[1:], strict=False)]


def _append_texts(qkey: str, plan: dict[str, Any], body_words: int) -> list[str]:
    """Chunk texts of an append query whose body (search result + pages) has `body_words` words."""
    search = max(5, round(body_words * plan["search_frac"]))
    sizes = [search, *_split(body_words - search, plan["page_weights"], 5)]
    # each page its own stream, so a page reads as a whole and its text does not move when another page resizes
    texts = [_Words(f"{qkey}/chunk{i}").text(n) + "\n" for i, n in enumerate(sizes)]
    texts[0] = TEMPLATE + texts[0]
    texts[-1] += QUESTION_PREFIX + plan["question"]
    return texts


def _update_versions(qkey: str, plan: dict[str, Any], body_words: int) -> list[str]:
    """Full input of each version of an update query, each holding ~`body_words` words of ranked documents."""
    sizes, streams = plan["doc_sizes"], {}
    next_doc = 0

    def doc_text(idx: int, n: int) -> str:
        if idx not in streams:
            streams[idx] = _Words(f"{qkey}/doc{idx}")
        return streams[idx].text(n)

    def fill(ranked: list[tuple[int, int]]) -> list[tuple[int, int]]:
        nonlocal next_doc
        have = sum(n for _, n in ranked)
        while have < body_words:  # the last document is cut to the budget, like a context limit would
            n = min(sizes[next_doc % len(sizes)], body_words - have)
            ranked.append((next_doc, n))
            next_doc, have = next_doc + 1, have + n
        return ranked

    ranked = fill([])
    versions = [ranked]
    for frac in plan["keep_fracs"]:
        keep = max(1, min(len(ranked) - 1, round(frac * len(ranked)))) if len(ranked) > 1 else 0
        ranked = fill(list(ranked[:keep]))
        versions.append(ranked)
    return [
        TEMPLATE + "".join(doc_text(i, n) + "\n" for i, n in v) + QUESTION_PREFIX + plan["question"] for v in versions
    ]


def _fit(
    build: Callable[[int], list[str]],
    final: Callable[[list[str]], str],
    window: tuple[float, float],
    floor: int,
    counter: Callable[[str], int],
    per_word: float,
) -> tuple[list[str], int]:
    """Rebuild with more or fewer body words until the final input's tokens fall in `window` (lo, hi)."""
    lo, hi = window
    aim = (lo + hi) / 2
    overhead = counter(final(build(floor)))  # tokens that do not scale with the body (template, question, floors)
    n = max(floor, round((aim - overhead) / per_word) + floor)
    best: tuple[float, list[str], int] | None = None
    for _ in range(8):
        texts = build(n)
        got = counter(final(texts))
        miss = max(lo - got, got - hi, 0)
        if best is None or miss < best[0]:
            best = (miss, texts, got)
        if miss == 0:
            break
        per_word = max(got - overhead, 1) / max(n - floor, 1)
        step = floor + round((aim - overhead) / per_word) - n
        n = max(floor, n + (step or (1 if got < lo else -1)))  # always move, or rounding could stall below lo
    assert best is not None
    return best[1], best[2]


def common_prefix(a: str, b: str) -> int:
    """Characters `a` and `b` share from the start."""
    return len(os.path.commonprefix([a, b]))


def generate(
    kind: str,
    *,
    queries: int,
    qps: float,
    seed: int = 0,
    delay_multiplier: float = 1.0,
    tokens_median: int = 1800,
    tokens_max: int = 3400,
    tokens_min: int = 600,
    count_tokens: Callable[[str], int] | None = None,
    first_median_s: float | None = None,
) -> Trace:
    """A seeded trace of `queries` queries of `kind` ("append", "update"; "pressure" = append shape).

    Timing, chunk counts and token targets come from one Random(seed) in a fixed order, and text from per-query
    seeded streams, so qps only scales arrivals and delay_multiplier only scales within-query times (the queries'
    text is the same); a tokenizer changes only how many words each text gets. `first_median_s` overrides the
    shape's median time of the first chunk (e.g. ~3 s makes update's collection time match the paper's ~4 s)."""
    if kind not in SHAPES:
        raise ValueError(f"unknown workload kind {kind!r}: one of {sorted(SHAPES)}")
    if not 0 < tokens_min <= tokens_median <= tokens_max:
        raise ValueError("need 0 < tokens_min <= tokens_median <= tokens_max")
    shape = dict(SHAPES[kind])
    if first_median_s is not None:
        shape["first_median_s"] = first_median_s
    update = kind == "update"
    rng = random.Random(seed)
    counter = count_tokens or estimate_tokens
    sample = " ".join(_Words("calibration").take(1000))
    per_word = counter(sample) / 1000  # this tokenizer's tokens per filler word: the first guess of every query
    out: list[Query] = []
    arrival = 0.0
    for qid in range(queries):
        arrival += rng.expovariate(1.0) / qps  # unit draw then scale: qps does not change the other draws
        if update:
            n_chunks = round(rng.lognormvariate(math.log(shape["chunks_median"]), shape["chunks_sigma"]))
        else:
            n_chunks = round(rng.gauss(shape["chunks_mu"], shape["chunks_sd"]))
        n_chunks = min(max(n_chunks, shape["chunks_min"]), shape["chunks_max"])
        t = rng.lognormvariate(math.log(shape["first_median_s"]), shape["first_sigma"])
        times = [t]
        for _ in range(n_chunks - 1):
            t += rng.lognormvariate(math.log(shape["gap_median_s"]), shape["gap_sigma"])
            times.append(t)
        target = round(rng.lognormvariate(math.log(tokens_median), shape["tokens_sigma"]))
        target = min(max(target, tokens_min), tokens_max)
        window = (max(tokens_min, 0.98 * target), 1.02 * target)  # within 2%, never under tokens_min
        qkey = f"{seed}/{qid}"
        srng = random.Random(f"{qkey}/structure")  # per-query, so text sizes never shift the shared draws
        plan: dict[str, Any] = {"question": _question(srng)}
        if update:
            lo, hi = shape["doc_tokens"]
            plan["doc_sizes"] = [max(5, round(srng.randint(lo, hi) / per_word)) for _ in range(64)]  # in words
            plan["keep_fracs"] = [srng.uniform(*shape["keep_frac"]) for _ in range(n_chunks - 1)]
            texts, got = _fit(
                lambda n, p=plan, k=qkey: _update_versions(k, p, n), lambda ts: ts[-1], window, 1, counter, per_word
            )
            mode = "replace"
        else:
            plan["search_frac"] = srng.uniform(*shape["search_frac"])
            plan["page_weights"] = [srng.uniform(0.2, 1.8) for _ in range(n_chunks - 1)]
            floor = 5 * n_chunks
            texts, got = _fit(
                lambda n, p=plan, k=qkey: _append_texts(k, p, n), "".join, window, floor, counter, per_word
            )
            mode = "append"
        invalidated = None
        if update and count_tokens is not None:  # the tail past the common prefix: the cached tokens an update drops
            invalidated = sum(count_tokens(a[common_prefix(a, b) :]) for a, b in zip(texts, texts[1:], strict=False))
        chunks = [
            Chunk(at_s=round(s * delay_multiplier, 6), text=x, mode=mode) for s, x in zip(times, texts, strict=True)
        ]
        out.append(
            Query(
                id=qid,
                arrival_s=round(arrival, 6),
                chunks=chunks,
                prompt_tokens=got if count_tokens is not None else None,
                invalidated_tokens=invalidated,
            )
        )
    params = {
        "kind": kind,
        "queries": queries,
        "qps": qps,
        "seed": seed,
        "delay_multiplier": delay_multiplier,
        "tokens_median": tokens_median,
        "tokens_min": tokens_min,
        "tokens_max": tokens_max,
        "tokenizer": count_tokens is not None,
        "shape": {k: list(v) if isinstance(v, tuple) else v for k, v in shape.items()},
    }
    return Trace(kind=kind, seed=seed, qps=qps, delay_multiplier=delay_multiplier, queries=out, params=params)


def compare_table(stats: dict[str, Any], paper: dict[str, Any]) -> str:
    """Our statistics beside the paper's, one key a line."""

    def fmt(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    keys = list(stats) + [k for k in paper if k not in stats and k != "source"]
    lines = [f"{'statistic':<22}{'ours':>14}{'paper':>14}"]
    lines += [f"{k:<22}{fmt(stats.get(k)):>14}{fmt(paper.get(k)):>14}" for k in keys]
    if "source" in paper:
        lines.append(f"paper: {paper['source']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=sorted(SHAPES))
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--qps", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delay-multiplier", type=float, default=1.0)
    ap.add_argument("--tokens-median", type=int, default=1800)
    ap.add_argument("--tokens-min", type=int, default=600)
    ap.add_argument("--tokens-max", type=int, default=3400)
    ap.add_argument("--first-median-s", type=float, default=None)
    ap.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer (path or name) to count tokens")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    count_tokens = token_counter(args.tokenizer) if args.tokenizer else None

    trace = generate(
        args.kind,
        queries=args.queries,
        qps=args.qps,
        seed=args.seed,
        delay_multiplier=args.delay_multiplier,
        tokens_median=args.tokens_median,
        tokens_min=args.tokens_min,
        tokens_max=args.tokens_max,
        count_tokens=count_tokens,
        first_median_s=args.first_median_s,
    )
    if args.out:
        trace.save(args.out)
        print(f"wrote {args.out}")
    print(compare_table(trace.stats(), PAPER.get(args.kind, {})))


if __name__ == "__main__":
    main()
