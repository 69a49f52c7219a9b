"""Runtime: profile + target backend + tokenizer + drafter + gamma policy. A Request (edgerun/request.py)
goes in: prepare() renders and compiles it, start() runs the decode loop, complete() collects the answer."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .backends import model_memory, open_backend
from .cluster.head import plan as cluster_plan
from .cluster.rpc import cluster_options, require_rpc
from .config import DEFAULT_MODEL, FIXED_GAMMA, BackendArgs, SamplingArgs, SpeculativeArgs, parse_gamma
from .constrain.base import Constraint
from .constrain.grammar import compile_constraint, grammar_from_options, vet_grammar
from .constrain.tools import chat_messages, parse_tool_calls
from .device import gpu as gpu_check
from .device.detect import resolve as resolve_profile
from .device.memory import check_memory_fit
from .engine.batch import BatchGroup
from .errors import ContextOverflow, InvalidArgument, MemoryBudgetError
from .generate import GenStats, Step, generate
from .request import Plan, Request, Structure, check_sampling
from .speculative.combined import SuffixOrModel, model_part
from .speculative.drafters import make_drafter
from .speculative.gamma import BatchedGamma, FixedGamma, GammaPolicy, GammaTuner
from .speculative.lazy import SlotDrafters, joining, plan as draft_plan
from .speculative.tuner_store import TunerStore, regime

log = logging.getLogger(__name__)


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str            # 'stop' (stop string) | 'eos' (end-of-generation token) | 'length' | 'tool_calls'
    n_prompt_tokens: int
    n_tokens: int
    stats: GenStats = field(default_factory=GenStats)
    tool_calls: list[dict] | None = None     # OpenAI shape, arguments as a JSON string (chat with tools)
    content: str | None = None               # the text outside the tool calls (chat with tools)

    def message(self) -> dict:
        """The assistant message, as OpenAI returns it (and as it goes back into `messages`)."""
        if self.tool_calls:
            return {"role": "assistant", "content": self.content, "tool_calls": self.tool_calls}
        return {"role": "assistant", "content": self.text}

    def to_dict(self) -> dict:
        d = {"text": self.text, "finish_reason": self.finish_reason, "n_prompt_tokens": self.n_prompt_tokens,
             "n_tokens": self.n_tokens, **self.stats.to_dict()}
        if self.tool_calls:
            d.update(tool_calls=self.tool_calls, content=self.content)
        return d


@dataclass(frozen=True)
class Generation:
    """One generation as the decode loop runs it (Runtime.start checks and fills it in)."""

    prompt_tokens: list[int]
    sampling: SamplingArgs
    max_tokens: int
    stop: tuple[str, ...]
    policy: GammaPolicy
    stats: GenStats
    constraint: Constraint | None


class Runtime:
    """A loaded target (+ optional drafter). Serves one generation at a time."""

    gpu = None       # device.gpu.GpuStatus of the target (load() sets it): where its layers run

    def __init__(self, target, *, model_name: str, drafter=None, draft_name: str | None = None,
                 profile=None, spec: SpeculativeArgs = SpeculativeArgs(), policy: GammaPolicy | None = None,
                 sampling: SamplingArgs = SamplingArgs(), tuner_store: TunerStore | None = None) -> None:
        self.target = target
        self.tokenizer = target.tokenizer
        self.model_name = model_name
        self.drafter = drafter
        self.draft_name = draft_name
        self.profile = profile
        self.spec = spec
        self.sampling = sampling
        self.policy = policy if policy is not None else FixedGamma(spec.gamma if spec.gamma is not None else FIXED_GAMMA)
        self.tuner_store = tuner_store       # persists what the gamma tuner learns (per sampling regime)
        self.cluster = getattr(target, "cluster", None)   # the RPC workers the target spreads over, if any
        self._tuners: dict[str, GammaTuner] = {}
        self.last_stats: GenStats | None = None
        self.session_stats = GenStats()
        self.group = None            # the BatchGroup of a slot (slots()): its decode loop runs batched
        self.joining = None          # a slot's SlotDrafters while the server's drafter loads (speculative/lazy.py)

    @property
    def n_ctx(self) -> int:
        return self.target.n_ctx

    # -- helpers ------------------------------------------------------------------------------
    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.tokenizer.tokenize(text, special=special, limit=self.n_ctx)

    def sampling_args(self, **kw) -> SamplingArgs:
        """The runtime's sampling defaults with the values given (checked)."""
        return replace(self.sampling, **dict(check_sampling({k: v for k, v in kw.items() if v is not None})))

    def _policy_for(self, gamma: int | None, sampling: SamplingArgs) -> GammaPolicy:
        """A fixed gamma if one is asked for; else the tuner of this sampling regime, continuing from what
        earlier processes learned when the runtime has a tuner store."""
        if gamma is not None:
            return FixedGamma(gamma)
        if sampling.seed is not None and not sampling.greedy and isinstance(self.policy, GammaTuner):
            # same seed, same text: the tuner's choices (learned, persisted, timed) decide which random numbers
            # each position draws, so a seeded sampled run decodes plainly unless a fixed gamma is asked for
            return FixedGamma(0)
        if self.tuner_store is None or not isinstance(self.policy, GammaTuner):
            return self.policy
        if self.policy not in self._tuners.values():
            self._tuners = {}                   # the policy was replaced: start over with it
        r = regime(sampling)
        if r not in self._tuners:
            t = self.policy if not self._tuners else self.policy.fresh()
            self.tuner_store.load(t, r)
            self._tuners[r] = t
        return self._tuners[r]

    def _check_prompt(self, tokens: Sequence[int]) -> None:
        if len(tokens) >= self.n_ctx:
            raise ContextOverflow(
                f"the prompt is {len(tokens)} tokens but the context holds {self.n_ctx} "
                f"(at least one position must stay free to generate); shorten the prompt or raise --ctx")

    # -- a request, end to end ----------------------------------------------------------------
    def prepare(self, request: Request) -> Plan:
        """Render the prompt and compile the grammar of a request (InvalidArgument, ContextOverflow)."""
        structure = request.structure.bind(self.tokenizer)
        if request.messages is not None:
            knows = self.tokenizer.template_knows_tools
            msgs = chat_messages(request.messages, structure.tools, knows)
            prompt = self.tokenizer.chat_prompt_tokens(
                msgs, tools=[t.openai() for t in structure.tools] if knows else None, limit=self.n_ctx)
        elif request.prompt_tokens is not None:
            prompt = list(request.prompt_tokens)
            n_vocab = self.tokenizer.n_vocab
            bad = next((t for t in prompt if not (isinstance(t, int) and 0 <= t < n_vocab)), None)
            if bad is not None:
                raise InvalidArgument(f"prompt token id {bad!r} is out of range; expected ids in 0..{n_vocab - 1}",
                                      param="prompt")
        else:
            prompt = self.tokenize(request.prompt)
        return Plan(prompt, compile_constraint(structure.grammar, self.tokenizer, self.target.n_vocab), structure)

    def start(self, request: Request, *, plan: Plan | None = None, max_tokens: int | None = None,
              stats: GenStats | None = None) -> "TokenStream":
        """The decode loop of a request (prepared now unless `plan` is given). Errors raise here, before the
        first token; closing the returned stream cancels and rolls the caches back. max_tokens: a limit
        below the request's (the server's room in the context); with neither, up to the context's end."""
        plan = plan if plan is not None else self.prepare(request)
        self._check_prompt(plan.prompt_tokens)
        if max_tokens is None:
            max_tokens = request.max_tokens if request.max_tokens is not None else self.n_ctx - len(plan.prompt_tokens)
        sampling = request.sampling_args(self.sampling)
        return TokenStream(self, Generation(list(plan.prompt_tokens), sampling, max_tokens, request.stop,
                                            self._policy_for(request.gamma, sampling),
                                            stats if stats is not None else GenStats(), plan.constraint))

    def complete(self, request: Request, *, plan: Plan | None = None) -> Completion:
        """The whole answer of a request; with tools, its calls read back (Completion.tool_calls)."""
        plan = plan if plan is not None else self.prepare(request)
        stats = GenStats()
        steps: list[Step] = []
        self.start(request, plan=plan, stats=stats).run(steps.append)   # a batching slot: on the engine
        out = Completion(text="".join(s.text for s in steps), tokens=[s.token for s in steps],
                         finish_reason=stats.finish_reason or "length", n_prompt_tokens=len(plan.prompt_tokens),
                         n_tokens=stats.n_tokens, stats=stats)
        if plan.reads_calls:
            out.content, calls = parse_tool_calls(out.text, list(plan.structure.tools))
            if calls:
                out.tool_calls = calls
                if out.finish_reason != "length":      # cut short: 'length' says so, the whole calls still count
                    out.finish_reason = "tool_calls"
        return out

    def vet_structure(self, structure: Structure) -> Structure:
        """Check a request's grammar (limits, then a compile in a sandbox process) without compiling it
        here, and return the structure bound to this vocabulary: the server calls it off the generation
        worker, so a bad grammar never holds the worker."""
        bound = structure.bind(self.tokenizer)
        vet_grammar(bound.grammar, self.tokenizer, self.target.n_vocab)
        return bound

    # -- the decode loop ----------------------------------------------------------------------
    def _loop(self, g: Generation) -> Iterator[Step]:
        """The decode loop's generator for one generation (nothing runs until it is iterated)."""
        if self.joining is not None:
            self.joining.attach_if_quiet()      # before the drafter is read: a loaded one joins when all is quiet
        rng = np.random.default_rng(g.sampling.seed)
        batched = self.group is not None and isinstance(g.policy, GammaTuner)
        # in a batch of several sequences, drafts only where they still pay (speculative/gamma.py)
        run_policy = BatchedGamma(g.policy, lambda: self.group.n_active) if batched else g.policy
        return generate(self.target, g.prompt_tokens, g.sampling, max_tokens=g.max_tokens, stop=list(g.stop),
                        drafter=self.drafter, policy=run_policy, rng=rng, stats=g.stats, constraint=g.constraint)

    def _finish(self, g: Generation) -> None:
        self.last_stats = g.stats
        self.session_stats.merge(g.stats)
        if self.tuner_store is not None and any(g.policy is t for t in self._tuners.values()):
            self.tuner_store.save(g.policy, regime(g.sampling))

    def _run(self, g: Generation) -> Iterator[Step]:
        try:
            steps = self._loop(g)
            yield from (steps if self.group is None else self.group.drive(steps, self.batch_views()))
        finally:
            self._finish(g)

    def _run_with(self, g: Generation, on_step) -> None:
        """TokenStream.run: in a batching group, BatchGroup.run (a loop that joins others runs on the engine
        thread, on_step too); elsewhere the Steps are iterated on this thread."""
        if self.group is None:
            it = self._run(g)
            try:
                for step in it:
                    if on_step(step) is False:
                        break
            finally:
                it.close()
            return
        try:
            self.group.run(self._loop(g), on_step, self.batch_views())
        finally:
            self._finish(g)     # here: a tuner store's write holds up no batch

    # -- the Python API: keyword options -> a Request ------------------------------------------
    def generate(self, prompt: str, *, max_tokens: int = 256, **options) -> Completion:
        """Complete `prompt` (raw text, no chat template). options: Request.build's (sampling values, stop,
        gamma, json_schema / grammar / response_format)."""
        return self.complete(Request.build(prompt=prompt, max_tokens=max_tokens, **options))

    def chat(self, messages: Sequence[dict], *, max_tokens: int = 256, **options) -> Completion:
        """Answer the last message of a conversation, using the model's chat template. With `tools`
        (OpenAI shape) the answer may be tool calls: Completion.tool_calls, finish_reason 'tool_calls';
        Completion.message() is the assistant message to append to `messages`."""
        return self.complete(Request.build(messages=messages, max_tokens=max_tokens, **options))

    def stream(self, prompt: str, *, max_tokens: int = 256, stats: GenStats | None = None,
               **options) -> "TokenStream":
        return self.start(Request.build(prompt=prompt, max_tokens=max_tokens, **options), stats=stats)

    def chat_stream(self, messages: Sequence[dict], *, max_tokens: int = 256, stats: GenStats | None = None,
                    **options) -> "TokenStream":
        """The answer's Steps (text as it comes; with tools, read the calls back with
        constrain.tools.ToolCallStream or use chat())."""
        return self.start(Request.build(messages=messages, max_tokens=max_tokens, **options), stats=stats)

    def stream_tokens(self, prompt_tokens: Sequence[int], *, max_tokens: int = 256, stats: GenStats | None = None,
                      constraint: Constraint | None = None, **options) -> "TokenStream":
        """The decode loop on explicit prompt tokens, under an already compiled `constraint` if given
        (from constraint() or plan_chat())."""
        request = Request.build(prompt_tokens=prompt_tokens, max_tokens=max_tokens, **options)
        return self.start(request, plan=Plan(list(prompt_tokens), constraint), stats=stats)

    def plan_chat(self, messages: Sequence[dict], **structure) -> Plan:
        """prepare() of a chat request with these structure options (tools, json_schema, ...)."""
        return self.prepare(Request.build(messages=messages, **structure))

    def constraint(self, *, json_schema=None, grammar: str | None = None, response_format=None) -> Constraint | None:
        """The constraint of a JSON schema (dict or JSON text), a grammar (Lark with a `start:` rule, or
        a regex) or an OpenAI response_format; None when none is given. Compile errors raise here."""
        return compile_constraint(grammar_from_options(json_schema=json_schema, grammar=grammar,
                                                       response_format=response_format),
                                  self.tokenizer, self.target.n_vocab)

    # -- continuous batching ------------------------------------------------------------------
    @property
    def parallel(self) -> int:
        """Sequences the target's context holds (BackendArgs.n_seq; 1 for one-sequence backends)."""
        return getattr(self.target, "n_seq", 1)

    def slots(self) -> list["Runtime"]:
        """One Runtime per sequence of a multi-sequence target (load(parallel=N)), sharing one BatchGroup:
        run one generation on each from its own thread and their steps are evaluated together
        (edgerun/engine/batch.py). Each has its own view of the caches, drafter state and gamma policy;
        closing one closes nothing shared (close this Runtime for that)."""
        n = self.parallel
        model = model_part(self.drafter) if self.drafter is not None else None
        draft_be = model.backend if model is not None else None
        if draft_be is not None and getattr(draft_be, "n_seq", 1) != n:
            raise InvalidArgument(f"the drafter's context holds {getattr(draft_be, 'n_seq', 1)} sequences but the "
                                  f"target's {n}; load both with the same parallel")
        group = BatchGroup([b for b in (draft_be, self.target) if b is not None])
        lazy = joining(self.drafter)            # a server's drafter loading on its thread joins the slots later
        later = SlotDrafters(lazy, group) if lazy is not None else None
        out = []
        for i in range(n):
            drafter = None
            if later is not None:
                drafter = later.placeholder(self.drafter)
            elif self.drafter is not None:
                drafter = copy.copy(self.drafter)
                if draft_be is not None:
                    model_part(drafter).backend = group.view(draft_be, i)
                drafter.reset()
            policy = self.policy.fresh(seed=i) if isinstance(self.policy, GammaTuner) else self.policy
            slot = Runtime(group.view(self.target, i), model_name=self.model_name, drafter=drafter,
                           draft_name=self.draft_name, profile=self.profile, spec=self.spec, policy=policy,
                           sampling=self.sampling, tuner_store=self.tuner_store)
            slot.group, slot.joining = group, later
            out.append(slot)
        if later is not None:
            later.slots = out
        return out

    def batch_views(self) -> list:
        """A slot's sequence views (target first, then a model drafter's), as its decode loop joins the
        group with them: BatchGroup.move() takes two slots' lists."""
        views = [self.target]
        model = model_part(self.drafter) if self.drafter is not None else None
        if model is not None:
            views.append(model.backend)
        return views

    def reset(self) -> None:
        """Forget the cached conversation (KV caches of target and drafter)."""
        self.target.truncate(0)
        if self.drafter is not None and hasattr(self.drafter, "reset"):
            self.drafter.reset()

    def idle(self) -> None:
        """Nothing generates now (a server with no job, chat waiting for its user): start the backends' huge-page
        collapse (util/hugepages.py), which helps long runs only, on its own thread. A one-shot never calls it."""
        lazy = joining(self.drafter)            # a drafter loaded later: its backend, once loaded
        model = model_part(self.drafter) if lazy is None and self.drafter is not None else lazy and lazy.loaded
        for backend in (self.target, model.backend if model is not None else None):
            pending = getattr(backend, "huge", None)
            if pending is not None:
                pending.start()

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()
        self.target.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(model: str | Path = DEFAULT_MODEL, draft: str | None = "auto", profile: str = "auto", *,
         n_ctx: int | None = None, n_threads: int | None = None, n_gpu_layers: int | None = None,
         flash_attn: bool | None = None, gamma=None, gamma_max: int | None = None, p_min: float | None = None,
         pull: bool = True, progress=None, sampling: SamplingArgs | None = None, rpc=None,
         tensor_split=None, on_lost_worker=None, parallel: int | None = 1, require_gpu: bool = False,
         draft_background: bool = False) -> Runtime:
    """Load a target model (registry name, .gguf path or exported ONNX directory) and its drafter.

    draft: 'auto' (the registry's paired drafter if any, else 'suffix'), 'none'/None, 'lookup', 'suffix', or a model.
    profile: 'auto' (detect the device), a profile name, or a YAML path.
    rpc: RPC workers ('HOST:PORT,...' or a list; `edgerun worker` on each board): the target's layers spread
    over them (docs/cluster.md), the drafter stays here. tensor_split: one share per worker device, optionally
    one more (last) for this machine; default: by the workers' free memory. A worker lost later ends the
    process (llama.cpp cannot continue): on_lost_worker(endpoints, ggml's message) is called first (default: one `error:`
    line on stderr, exit status 2).
    parallel: sequences the llama.cpp contexts hold for continuous batching (Runtime.slots), None for the
    profile's; each gets n_ctx positions of KV cache, and the memory check counts them all. An ONNX
    target keeps one.
    require_gpu: raise GpuRequired (edgerun/device/gpu.py) unless the target's layers are all on a GPU; without
    it a profile that expects a GPU (Jetson, Apple) only warns when they are not.
    draft_background: (a server) a drafter the tuner's stored state drafts with loads on a thread while the
    target already answers. Either way one the stored state says will not draft loads at its first draft
    (speculative/lazy.py).
    """
    # resolve.py imports convert/, the GGUF writer and the ONNX exporter: 0.3-0.4 s measured after the rest of
    # runtime.py, which `edgerun serve` imports before it listens (the model loads after /health answers)
    from .resolve import auto_draft, resolve_model

    rpc, tensor_split = cluster_options(rpc, tensor_split)      # before anything is detected, pulled or loaded
    if rpc:
        require_rpc("--rpc")
    prof, why = resolve_profile(profile)
    log.info("device profile %s (%s)", prof.name, why)
    overrides = {k: v for k, v in dict(n_ctx=n_ctx, n_threads=n_threads, n_gpu_layers=n_gpu_layers,
                                       flash_attn=flash_attn).items() if v is not None}
    args: BackendArgs = prof.backend_args(**overrides)
    if require_gpu:                      # a build without a GPU fails before any model is pulled or loaded
        gpu_check.enforce(gpu_check.check(prof, n_gpu_layers=args.n_gpu_layers, require=True), True)
    spec = SpeculativeArgs(gamma=parse_gamma(gamma),
                           **{k: v for k, v in dict(gamma_max=gamma_max, p_min=p_min).items() if v is not None})

    if parallel is None:
        parallel = prof.llama.parallel
    if not isinstance(parallel, int) or not 1 <= parallel <= 64:
        raise InvalidArgument(f"parallel must be an integer in 1..64 (sequences served at once), got {parallel!r}")
    target_path = Path(resolve_model(str(model), pull=pull, progress=progress))
    if parallel != 1 and target_path.is_dir():
        log.info("the ONNX backend holds one sequence: serving one generation at a time (parallel 1)")
        parallel = 1
    args = replace(args, n_seq=parallel)
    combined = draft == "auto"              # a model drafter found for auto goes with suffix lookup (combined.py)
    if draft == "auto":
        draft = auto_draft(str(model))      # a paired or same-vocabulary model drafter, else suffix lookup
    draft_path = None
    if draft not in (None, "none", "lookup", "suffix"):
        draft_path = Path(resolve_model(str(draft), pull=pull, progress=progress))
    target_bytes, kv_bytes = model_memory(target_path, args.n_ctx)
    draft_bytes, draft_kv = model_memory(draft_path, args.n_ctx) if draft_path else (0, 0)
    cluster = None
    if rpc:
        cluster = cluster_plan(rpc, tensor_split, target_path, kv_bytes=kv_bytes * parallel, n_gpu_layers=n_gpu_layers)
        target_bytes, kv_bytes = cluster.placement.head_bytes, cluster.placement.head_kv // parallel
    _check_fit(prof, target_bytes, draft_bytes, kv_bytes + draft_kv, parallel, args.n_ctx)

    if cluster is not None:
        cluster.attach(on_lost_worker)
    target = open_backend(target_path, args, cluster=cluster)
    try:
        gpu = gpu_check.check(prof, target, n_gpu_layers=args.n_gpu_layers, require=require_gpu)
        gpu_check.enforce(gpu, require_gpu)
        combined = combined and draft_path is not None
        lazy = draft_plan(draft_path, target, args, spec, prof, parallel=parallel, background=draft_background,
                          combined=combined)
        drafter = lazy[0] if lazy else make_drafter(
            None if draft is None else (str(draft_path) if draft_path else draft), target, backend_args=args,
            spec_args=spec, pull=pull)
        if combined:
            drafter = SuffixOrModel(drafter)
        policy, store = lazy[1:] if lazy else (None, None)
        if lazy is None and drafter is not None and spec.gamma is None:
            policy = GammaTuner.for_runtime(prof, target, drafter, spec)
            store = TunerStore.for_pair(target, drafter)
        rt = Runtime(target, model_name=str(model), drafter=drafter,
                     draft_name=None if draft in (None, "none") else str(draft), profile=prof, spec=spec,
                     policy=policy, sampling=sampling or SamplingArgs(), tuner_store=store)
        rt.gpu = gpu
        return rt
    except BaseException:
        target.close()
        raise


def _check_fit(prof, target_bytes: int, draft_bytes: int, kv_bytes: int, parallel: int, n_ctx: int) -> None:
    """The memory check of a load (MemoryBudgetError), naming --parallel where several KV caches are asked for."""
    try:
        check_memory_fit(prof, target_bytes=target_bytes, draft_bytes=draft_bytes, kv_bytes=kv_bytes * parallel,
                         n_ctx=n_ctx)
    except MemoryBudgetError as e:
        if parallel == 1:
            raise
        raise MemoryBudgetError(f"{e}; or fewer generation slots (--parallel {parallel} reserves {parallel} "
                                f"KV caches of {n_ctx} positions)") from None


class TokenStream:
    """One generation's Steps (Runtime.start): iterate it, or hand it a callback with run().

    Iterating runs the decode loop on the iterating thread (in a batching group, as a member with a thread
    of its own: BatchGroup.drive). run(on_step) calls on_step(step) for each Step until it returns False or
    the generation ends; in a batching group a loop that runs beside others runs on the engine thread,
    which steps every such member itself (BatchGroup.run, the server's slots), so on_step must be quick
    there (wrap a wait in engine.blocking). Either way closing or stopping it rolls the caches back to what was
    committed. A stream runs once."""

    def __init__(self, runtime: Runtime, generation: Generation) -> None:
        self._rt, self._g = runtime, generation
        self._gen: Iterator[Step] | None = None
        self._used = False

    def __iter__(self) -> "TokenStream":
        return self

    def __next__(self) -> Step:
        if self._gen is None:
            if self._used:
                raise StopIteration
            self._used = True
            self._gen = self._rt._run(self._g)
        return next(self._gen)

    def close(self) -> None:
        self._used = True
        if self._gen is not None:
            self._gen.close()

    def run(self, on_step) -> None:
        """Call on_step(step) for each Step (see the class); what the loop or on_step raises raises here."""
        if self._used:
            raise RuntimeError("this stream has run already")
        self._used = True
        self._rt._run_with(self._g, on_step)
