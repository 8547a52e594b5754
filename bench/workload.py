"""Benchmark workloads: request lengths, arrival times and prompt text, all from a seed.

A workload is a deterministic stream of :class:`BenchRequest` (index, arrival offset, prompt,
max_tokens). The same seed gives the same stream in every process, so ``--procs N`` splits it
by index (process k takes ``index % N == k``) and the union is exactly the single-process run.

Length distributions (``LengthDist.parse``), in tokens, clipped to ``[1, max]``:

- ``fixed:N``
- ``uniform:LO:HI`` (inclusive)
- ``lognormal:MEDIAN:SIGMA[:MAX]`` (``exp(N(ln MEDIAN, SIGMA))``; MAX defaults to 16 x MEDIAN)
- ``bimodal:SHORT:LONG:P_LONG`` (SHORT or LONG, each +-20 % uniform jitter; with probability
  P_LONG the LONG mode). When both prompt and output are bimodal, one draw picks the mode of
  both, so a request is a "long document" (long prompt, its output mode) or a "chat" turn.

Arrivals: open loop at ``rate`` req/s are a Poisson process (exponential gaps from the seed);
closed loop ignores them. A JSONL trace (:func:`load_trace`) gives recorded arrivals instead.

Prompt text is synthesized to a target token count from short common English words, each one
token both in BPE tokenizers (leading space + word) and in the simulator's tokenizer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

# Each is one token with a leading space in GPT/Qwen-style BPE vocabularies, and <= 4 chars.
_WORDS = ["the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "as", "with", "his", "they", "at", "be", "this", "from", "have", "or", "by", "one", "had", "not", "but", "what", "all", "were", "when", "we", "there", "can", "an", "your", "which", "their", "said", "if", "do", "will", "each", "about", "how", "up", "out", "them", "then", "she", "many", "some", "so", "these", "would", "other", "into", "has", "more", "her", "two", "like", "him", "see", "time", "could", "no", "make", "than", "first", "been", "its", "who", "now", "people", "my", "made", "over", "did", "down", "only", "way", "find", "use", "may", "water", "long", "little", "very", "after", "words", "called", "just", "where", "most", "know", "get", "through", "back", "much", "go", "good", "new", "write", "our", "me", "man", "too", "any", "day", "same", "right", "look", "think", "also", "around"]
_WORDS = tuple(w for w in _WORDS if len(w) <= 4)


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal | bimodal
    a: float
    b: float = 0.0
    c: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, _, rest = spec.partition(":")
        nums = [float(x) for x in rest.split(":")] if rest else []
        want = {"fixed": (1, 1), "uniform": (2, 2), "lognormal": (2, 3), "bimodal": (3, 3)}
        if kind not in want:
            raise ValueError(f"unknown length distribution {spec!r}; use one of {sorted(want)}")
        lo, hi = want[kind]
        if not lo <= len(nums) <= hi:
            raise ValueError(f"{kind} takes {lo}..{hi} numbers: {spec!r}")
        if kind == "lognormal" and len(nums) == 2:
            nums.append(16 * nums[0])
        if any(x < 0 for x in nums) or (kind != "bimodal" and nums[0] < 1):
            raise ValueError(f"bad numbers in {spec!r}")
        if kind == "uniform" and nums[1] < nums[0]:
            raise ValueError(f"uniform needs LO <= HI: {spec!r}")
        if kind == "bimodal" and not 0.0 <= nums[2] <= 1.0:
            raise ValueError(f"bimodal P_LONG must be in [0, 1]: {spec!r}")
        return cls(kind, *nums)

    def __str__(self) -> str:
        nums = {"fixed": 1, "uniform": 2, "lognormal": 3, "bimodal": 3}[self.kind]
        return ":".join([self.kind, *(f"{x:g}" for x in (self.a, self.b, self.c)[:nums])])

    def sample(self, rng: random.Random, u_mode: float) -> int:
        """One length. ``u_mode`` in [0, 1) picks the bimodal mode (shared across dimensions)."""
        k = self.kind
        if k == "fixed":
            v = self.a
        elif k == "uniform":
            v = rng.randint(int(self.a), int(self.b))
        elif k == "lognormal":
            v = min(math.exp(rng.gauss(math.log(self.a), self.b)), self.c)
        else:
            base = self.b if u_mode < self.c else self.a
            v = base * rng.uniform(0.8, 1.2)
        return max(1, round(v))


def length_arg(spec: str) -> LengthDist:
    """``LengthDist.parse`` as an argparse ``type=`` (a bad spec is a usage error)."""
    try:
        return LengthDist.parse(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


# The raw-vLLM reference's workload (gpumesh_bench.gpu.reference): 32 prompt tokens and 256 output
# tokens a request. The GPU bench compares with the reference's figures only on it.
REFERENCE_PROMPT = LengthDist("fixed", 32)
REFERENCE_OUTPUT = LengthDist("fixed", 256)


@dataclass(frozen=True)
class BenchRequest:
    index: int
    arrival_s: float  # offset from the run's start (open loop); ignored in closed loop
    prompt_tokens: int  # target count (synthesized text) or the text's recorded count
    max_tokens: int
    prompt_text: str | None = None  # None -> synthesized from (seed, index) at send time
    model: str = ""


@dataclass(frozen=True)
class WorkloadSpec:
    prompt: LengthDist = LengthDist("fixed", 128)
    output: LengthDist = LengthDist("fixed", 128)
    seed: int = 0
    model: str = ""
    rate: float = 0.0  # req/s for Poisson arrivals; 0 -> all arrivals at 0 (closed loop)


def iter_requests(spec: WorkloadSpec) -> Iterator[BenchRequest]:
    """The infinite deterministic request stream of ``spec``."""
    rng = random.Random(spec.seed)
    gaps = random.Random(spec.seed ^ 0x5EED)
    t = 0.0
    for i in itertools.count():
        u = rng.random()
        p = spec.prompt.sample(rng, u)
        o = spec.output.sample(rng, u)
        if spec.rate > 0 and i > 0:
            t += gaps.expovariate(spec.rate)
        yield BenchRequest(i, t, p, o, None, spec.model)


def synth_prompt(n_tokens: int, seed: int, index: int) -> str:
    """About ``n_tokens`` tokens of text, unique per (seed, index) so no prefix cache helps."""
    rng = random.Random((seed << 32) ^ (index * 0x9E3779B1))
    words = _WORDS
    return " ".join(rng.choice(words) for _ in range(n_tokens))


def prompt_text(req: BenchRequest, seed: int) -> str:
    return req.prompt_text if req.prompt_text is not None else synth_prompt(req.prompt_tokens, seed, req.index)


def load_trace(path: str | Path, model: str = "", time_scale: float = 1.0) -> list[BenchRequest]:
    """Read a JSONL trace. Each line: ``{"arrival_s": 0.25, "prompt_tokens": 512 | "prompt":
    "text", "max_tokens": 128, "model": "m"}`` (``t`` is accepted for ``arrival_s``). Records
    are sorted by arrival; ``time_scale`` multiplies the offsets (0.5 = twice the rate)."""
    out: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                r = json.loads(line)
                arrival = float(r.get("arrival_s", r.get("t", 0.0))) * time_scale
                text = r.get("prompt")
                n = int(r["prompt_tokens"]) if "prompt_tokens" in r else max(1, len(str(text)) // 4)
                out.append(BenchRequest(0, arrival, n, int(r["max_tokens"]), text,
                                        str(r.get("model") or model)))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad trace record ({exc})") from exc
    out.sort(key=lambda r: r.arrival_s)
    return [BenchRequest(i, r.arrival_s, r.prompt_tokens, r.max_tokens, r.prompt_text, r.model)
            for i, r in enumerate(out)]


def save_trace(requests: Iterable[BenchRequest], path: str | Path) -> int:
    """Write requests as a JSONL trace (synthesized prompts stay counts). Returns the count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for r in requests:
            rec = {"arrival_s": round(r.arrival_s, 6), "prompt_tokens": r.prompt_tokens,
                   "max_tokens": r.max_tokens}
            if r.prompt_text is not None:
                rec["prompt"] = r.prompt_text
            if r.model:
                rec["model"] = r.model
            f.write(json.dumps(rec) + "\n")
            n += 1
    return n
