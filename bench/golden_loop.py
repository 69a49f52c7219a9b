"""A golden run over the decode loop: what generate() commits, counts and asks of its backend, for a fixed
matrix of cases on the numpy reference backend (the tiny models of tests/tinymodel.py). No timings.

    python bench/golden_loop.py [--out bench/results/golden_loop.json] [--check FILE]

Cases: two prompts x greedy and sampled (temperature 0.8, seeds 0-2, and a repetition penalty) x no drafter,
a model drafter (other weights), the target's own weights as drafter, prompt lookup and suffix lookup x
gamma 0/1/4 x no constraint, a JSON schema (forced runs on and off) and a regex with long forced runs; then
stop strings, max_tokens 0/1/5, a context that fills, a backend that evaluates ahead (begin_eval, also one
that sometimes declines), a policy that records what the loop asks of it (hints, lags, plain cycles, and
which observations carry times), streams closed early, and a drafter that breaks the constraint contract.

Each case records the Steps (token, text, from_draft, gamma, n_accepted, forced), the counters of GenStats,
the finish reason, the backend's calls (eval length and logits rows, truncates, begin_eval) and the caches
and constraint after the generation. The JSON is written with sorted keys, so two trees that behave alike
give byte-identical files: run it before and after a change to the loop and compare (--check FILE does,
and exits 1 on a difference). tests/test_loop_golden.py compares each case's digest with
tests/fixtures/loop_golden.json (written by --digests tests/fixtures/loop_golden.json).
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))    # tinymodel.py: the tiny GGUFs the tests use

PROMPTS = ("Hello there, the world", "the net is in the net is in the")
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
    "n": {"type": "integer", "minimum": 0, "maximum": 999}, "ok": {"type": "boolean"}},
    "required": ["name", "kind", "n", "ok"], "additionalProperties": False}
REGEX = r"kx(in|is|at|an)qvz( (the|a) [a-z]{2,5}){1,3}!"
COUNTERS = ("n_prompt_tokens", "n_tokens", "n_cycles", "n_drafted", "n_accepted", "n_rejected", "gamma_sum",
            "accept_histogram", "finish_reason", "n_forced", "n_forced_runs")


class Traced:
    """A reference backend whose calls are logged: 'e<n>/<logits rows>', 't<n>' (only truncates that drop
    positions), 'b<n>/<rows>' (begin_eval). ahead='always' gives it begin_eval (evaluated at once, the
    result handed over by the waiter); ahead='some' declines every third begin_eval (returns None)."""

    def __init__(self, inner, ahead: str | None = None) -> None:
        self.inner, self.log = inner, []
        self.name, self.n_vocab, self.n_ctx = inner.name, inner.n_vocab, inner.n_ctx
        self.tokenizer, self.vocab_fingerprint, self.weight_bytes = (inner.tokenizer, inner.vocab_fingerprint,
                                                                     inner.weight_bytes)
        self._n_begun = 0
        if ahead is not None:
            self.begin_eval = self._begin_eval
            self._decline = ahead == "some"

    @property
    def tokens(self):
        return self.inner.tokens

    @property
    def n_past(self) -> int:
        return self.inner.n_past

    def eval(self, tokens, n_logits=None):
        self.log.append(f"e{len(tokens)}/{n_logits}")
        return self.inner.eval(tokens, n_logits)

    def _begin_eval(self, tokens, n_logits=None):
        self._n_begun += 1
        if self._decline and self._n_begun % 3 == 0:
            self.log.append("b-")
            return None
        self.log.append(f"b{len(tokens)}/{n_logits}")
        logits = self.inner.eval(tokens, n_logits)
        return lambda: logits

    def truncate(self, n: int) -> None:
        if n < self.inner.n_past:
            self.log.append(f"t{n}")
        self.inner.truncate(n)

    def close(self) -> None:
        self.inner.close()


def recording_policy(gammas, plain_every: int = 0):
    """A GammaTuner in name only (the loop tells a tuner whether an observation's times are the gamma + 1
    positions'): it drafts gammas[i % len] tokens, runs every plain_every-th cycle plain (plain_cycle), and
    logs every call the loop makes."""
    from edgerun.speculative.gamma import GammaTuner

    class Recording(GammaTuner):
        def __init__(self) -> None:            # no tuner state: nothing here is measured
            self.log, self.i, self.n = [], 0, 0

        def plain_cycle(self, lag: int = 0) -> bool:
            self.n += 1
            plain = bool(plain_every) and self.n % plain_every == 0
            self.log.append(f"p{lag}:{int(plain)}")
            return plain

        def choose(self, hint=0, lag: int = 0) -> int:
            self.log.append(f"c{hint}:{lag}")
            self.i += 1
            return 0 if hint is None else gammas[(self.i - 1) % len(gammas)]

        def observe(self, gamma, n_accepted, t_draft, t_verify, *, times: bool = True) -> None:
            self.log.append(f"o{gamma}:{n_accepted}:{int(times)}")

        def begin_generation(self) -> None:
            self.log.append("g")

    return Recording()


class ContractBreaker:
    """A drafter that drafts without advancing the constraint: the loop must raise BackendError."""

    name, vocab_fingerprint, weight_bytes, n_classes = "breaker", None, 0, 1

    def hint(self, context, logits=None):
        return 0

    def lag(self, context) -> int:
        return 0

    def propose(self, context, gamma, sampling, rng, constraint=None):
        return [int(context[-1])] * gamma, None

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class World:
    """The tiny models, written once; fresh backends, drafters and constraints per case."""

    def __init__(self, root: Path) -> None:
        from tinymodel import write_tiny_model
        from edgerun.reference.llama import ReferenceModel
        from edgerun.tokenizer import Tokenizer

        self.paths = {s: write_tiny_model(root / f"m{s}.gguf", arch="llama", wtype="f32", seed=s) for s in (0, 1)}
        self.models = {s: ReferenceModel.from_gguf(p) for s, p in self.paths.items()}
        self.tok = Tokenizer.from_gguf(self.paths[0])

    def backend(self, seed: int = 0, n_ctx: int | None = None):
        from edgerun.backends.reference import ReferenceBackend
        return ReferenceBackend(self.models[seed], tokenizer=self.tok, n_ctx=n_ctx, name=f"ref{seed}")

    def drafter(self, kind: str | None, target):
        from edgerun.speculative.drafters import ModelDrafter, PromptLookupDrafter
        from edgerun.speculative.suffix import SuffixDrafter
        if kind is None:
            return None
        if kind in ("other", "same"):
            return ModelDrafter(Traced(self.backend(1 if kind == "other" else 0)), target)
        if kind == "breaker":
            return ContractBreaker()
        return {"lookup": PromptLookupDrafter, "suffix": SuffixDrafter}[kind]()

    def constraint(self, kind: str | None, target):
        from edgerun.constrain.grammar import Grammar, GrammarConstraint
        if kind is None:
            return None
        grammar = {"json": lambda: Grammar.json_schema(SCHEMA), "regex": lambda: Grammar.regex(REGEX)}[kind]()
        return GrammarConstraint(grammar, self.tok, target.n_vocab)


def run_case(world: World, *, prompt: int = 0, temperature: float = 0.0, seed: int = 0, penalty: float = 1.0,
             drafter: str | None = None, gamma: int = 0, policy=None, constraint: str | None = None,
             forced: bool | None = None, stop=(), max_tokens: int = 32, room: int | None = None,
             ahead: str | None = None, take: int | None = None, eog: bool = True) -> dict:
    """One generation; its record."""
    import numpy as np
    from edgerun.config import SamplingArgs
    from edgerun.errors import EdgerunError
    from edgerun.generate import GenStats, generate
    from edgerun.speculative.gamma import FixedGamma

    prompt_tokens = world.tok.tokenize(PROMPTS[prompt])
    target = Traced(world.backend(0, None if room is None else len(prompt_tokens) + room), ahead)
    d = world.drafter(drafter, target)
    c = world.constraint(constraint, target)
    sampling = SamplingArgs(temperature=temperature, repeat_penalty=penalty, seed=seed)
    pol = policy if policy is not None else FixedGamma(gamma)
    stats = GenStats()
    steps, error = [], None
    stream = generate(target, prompt_tokens, sampling, max_tokens=max_tokens, stop=stop, drafter=d, policy=pol,
                      rng=np.random.default_rng(seed), stats=stats, constraint=c, forced_runs=forced,
                      is_eog=None if eog else (lambda t: False))
    try:
        for s in stream:
            steps.append([s.token, s.text, int(s.from_draft), s.gamma, s.n_accepted, int(s.forced)])
            if take is not None and len(steps) >= take:
                break
    except EdgerunError as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        stream.close()
    st = stats.to_dict()
    return {"steps": steps, "stats": {k: st[k] for k in COUNTERS}, "error": error,
            "target_calls": target.log, "target_cache": target.tokens[len(prompt_tokens) - 1:],
            "drafter_calls": getattr(getattr(d, "backend", None), "log", None),
            "constraint": None if c is None else list(c.tokens),
            "policy": getattr(policy, "log", None)}


def cases(world: World):
    """(name, kwargs) of every case, in a fixed order."""
    samplings = [("greedy", dict(temperature=0.0)), ("greedy-pen", dict(temperature=0.0, penalty=1.3))]
    samplings += [(f"t0.8-s{s}", dict(temperature=0.8, seed=s)) for s in (0, 1, 2)]
    samplings += [("t0.8-pen", dict(temperature=0.8, seed=3, penalty=1.3))]
    for prompt in (0, 1):
        for sname, skw in samplings:
            for cname, ckw in (("free", {}), ("json", dict(constraint="json")),
                               ("json-unforced", dict(constraint="json", forced=False)),
                               ("regex", dict(constraint="regex"))):
                yield f"p{prompt}/{sname}/{cname}/plain", dict(prompt=prompt, **skw, **ckw)
                for drafter in ("other", "same", "lookup", "suffix"):
                    for gamma in (0, 1, 4):
                        if gamma == 0 and drafter != "other":
                            continue                # gamma 0 is plain whatever the drafter: once is enough
                        if cname == "json-unforced" and gamma == 1:
                            continue
                        yield (f"p{prompt}/{sname}/{cname}/{drafter}-g{gamma}",
                               dict(prompt=prompt, drafter=drafter, gamma=gamma, **skw, **ckw))
    # limits: max_tokens, stop strings, a context that fills, end-of-generation ignored
    for m in (0, 1, 5):
        for cname in (None, "json", "regex"):
            yield f"max{m}/{cname}", dict(max_tokens=m, constraint=cname)
            yield f"max{m}/{cname}/other-g4", dict(max_tokens=m, constraint=cname, drafter="other", gamma=4)
    for stop in ([" the"], ["e"], ["\n", "wor"], ['"kind"', "at"], ["qvz", "!"]):
        for extra in ({}, dict(drafter="other", gamma=4), dict(drafter="lookup", gamma=1),
                      dict(constraint="json"), dict(constraint="regex", drafter="same", gamma=4),
                      dict(temperature=0.8, seed=1, drafter="other", gamma=4), dict(ahead="always")):
            yield f"stop{stop}/{sorted(extra.items())}", dict(stop=stop, prompt=1, **extra)
    for room in (0, 1, 2, 5, 12):            # context = prompt + room positions
        for extra in ({}, dict(drafter="other", gamma=4), dict(drafter="lookup", gamma=4), dict(constraint="regex"),
                      dict(ahead="always"), dict(constraint="json", drafter="same", gamma=4)):
            yield f"ctx+{room}/{sorted(extra.items())}", dict(room=room, max_tokens=40, eog=False, **extra)
    for extra in ({}, dict(drafter="other", gamma=4), dict(temperature=0.8, seed=2, drafter="lookup", gamma=4)):
        yield f"no-eog/{sorted(extra.items())}", dict(eog=False, max_tokens=48, **extra)
    # evaluation begun ahead (a lone sequence of a batching group), also declined now and then
    for ahead in ("always", "some"):
        for extra in ({}, dict(temperature=0.8, seed=0), dict(constraint="json"), dict(constraint="regex"),
                      dict(constraint="json", temperature=0.8, seed=1), dict(max_tokens=5), dict(max_tokens=1),
                      dict(drafter="other", gamma=4), dict(take=3), dict(room=6, eog=False),
                      # with a drafter whose cycles are sometimes plain (no match; a policy's 0): those begin ahead
                      dict(drafter="lookup", gamma=4), dict(drafter="lookup", gamma=4, constraint="json"),
                      dict(drafter="lookup", gamma=4, temperature=0.8, seed=1), dict(drafter="lookup", gamma=4, take=4),
                      dict(drafter="other", policy=((4, 0, 2), 2)),
                      dict(drafter="lookup", policy=((2, 4, 1), 0), constraint="regex")):
            yield f"ahead-{ahead}/{sorted(extra.items())}", dict(ahead=ahead, **extra)
    # a policy that records the loop's questions (hints, lags, plain cycles, times)
    for gammas, plain_every in (((2, 4, 1), 0), ((3,), 3), ((4, 0, 2), 2)):
        for extra in ({}, dict(constraint="json"), dict(constraint="regex"), dict(temperature=0.8, seed=1)):
            for drafter in ("other", "lookup"):
                yield (f"policy{gammas}/{plain_every}/{drafter}/{sorted(extra.items())}",
                       dict(drafter=drafter, policy=(gammas, plain_every), **extra))
    # streams closed early, and a drafter that breaks the contract
    for take in (1, 2, 5):
        for extra in ({}, dict(drafter="other", gamma=4), dict(constraint="regex"),
                      dict(constraint="json", drafter="lookup", gamma=4)):
            yield f"take{take}/{sorted(extra.items())}", dict(take=take, **extra)
    yield "breaker/json", dict(drafter="breaker", gamma=3, constraint="json")
    yield "breaker/free", dict(drafter="breaker", gamma=3)


def run_all(root: Path) -> dict:
    world = World(root)
    out = {}
    for name, kw in cases(world):
        if "policy" in kw:
            kw = dict(kw, policy=recording_policy(*kw["policy"]))
        out[name] = run_case(world, **kw)
    return out


def dumps(result: dict) -> str:
    return json.dumps(result, indent=1, sort_keys=True, ensure_ascii=True) + "\n"


def digests(result: dict) -> dict[str, str]:
    """Case name -> sha256 of its record (canonical JSON): the small form tests/fixtures/loop_golden.json keeps."""
    return {name: hashlib.sha256(json.dumps(rec, sort_keys=True, ensure_ascii=True).encode()).hexdigest()[:16]
            for name, rec in result.items()}


def dumps_digests(result: dict) -> str:
    return json.dumps(digests(result), indent=0, sort_keys=True) + "\n"


def main() -> None:
    # bench/ goes on the path only when run as a script: the test imports this module, and bench/onnx.py
    # would shadow the onnx package for the rest of the test session
    sys.path.insert(0, str(HERE))
    from harness import arg_parser, print_table

    ap = arg_parser(__doc__, out="golden_loop")
    ap.add_argument("--check", default=None, help="a golden file to compare with (exit 1 on a difference)")
    ap.add_argument("--digests", default=None, help="also write the per-case digests here (the test's fixture)")
    a = ap.parse_args()
    from edgerun.util.atomic import write_bytes

    with tempfile.TemporaryDirectory() as tmp:
        result = run_all(Path(tmp))
    text = dumps(result)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes(out, text.encode())      # the canonical text (sorted keys), replaced whole
    rows = [["cases", len(result)], ["tokens", sum(len(r["steps"]) for r in result.values())],
            ["forced", sum(r["stats"]["n_forced"] for r in result.values())],
            ["accepted", sum(r["stats"]["n_accepted"] for r in result.values())],
            ["errors", sum(r["error"] is not None for r in result.values())]]
    print_table(["what", "count"], rows, fmt=".0f", title=f"golden loop run -> {out}")
    if a.digests:
        write_bytes(Path(a.digests), dumps_digests(result).encode())
    if a.check:
        same = Path(a.check).read_text() == text
        print(f"{'identical to' if same else 'DIFFERS from'} {a.check}")
        sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
