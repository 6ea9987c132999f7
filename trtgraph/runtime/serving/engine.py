"""The replay-only runtime: load and check a manifest, re-record exactly its keys, lock,
then serve requests with continuous batching. After start-up it only replays (or, with
eager=True, runs the same steps eagerly for A/B checks); it never captures again and
never imports the compiler.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from ... import startup
from ...artifacts import load_manifest, manifest_path, use_triton_cache
from ...errors import ManifestError, PromptError
from ...models import load_tokenizer
from ...models.chat import load_chat_template
from ...models.parallel import TPGroup
from ..step.checks import check_manifest
from ..distributed import StepBroadcast, agree
from .drafter import NgramDrafter
from ..step.buffers import MAX_STOP_IDS
from ..step.executor import Executor, StepRow, resolve_device
from .requests import Request, Result, parse_request, resolve_sampling_defaults
from .scheduler import ScheduledStep, Scheduler, Sequence
from .stats import RunStats
from .streaming import RequestOutput, TextStream

# Re-recorded graphs may take a little more or less pool than at capture (allocator
# rounding, library versions); more than this means the plan or the machine changed.
POOL_TOLERANCE_FRACTION = 0.10
POOL_TOLERANCE_BYTES = 32 << 20


class Engine:
    def __init__(self, path: str | Path = "trtgraph-artifacts", eager: bool = False, speculative: bool = True,
                 tp: TPGroup = TPGroup(), model: str | Path | None = None):
        """speculative=False ignores the manifest's speculative section (plain decode steps),
        for A/B runs on the same capture. model: the checkpoint directory, where it has moved
        since capture (its files must match the manifest's sizes and sha256). With tensor
        parallelism every rank builds an Engine; rank 0 calls generate() and close(), the
        others follow()."""
        startup.begin()
        self.manifest = load_manifest(path)
        captured_tp = self.manifest.parallel.get("tensor_parallel_size", 1)
        if captured_tp != tp.world:
            raise ManifestError(f"{manifest_path(path)}: captured with tensor_parallel_size {captured_tp}, "
                                f"loaded on {tp.world} rank(s); `trtgraph run` starts the captured number itself.")
        self.tp = tp
        agree(tp, "the manifest", self.manifest.to_json()["digest"])
        self.artifacts_dir = manifest_path(path).parent
        config = _with_checkpoint(self.manifest.app_config(), manifest_path(path), model)
        device = resolve_device(config.device)
        diffs = check_manifest(self.manifest, device, weights=False)
        if diffs:
            raise ManifestError(_mismatch_message(manifest_path(path), diffs))
        use_triton_cache(self.manifest.paths["triton_cache"])
        self.eager = eager
        self.executor = ex = Executor.build(config, self.manifest.plan(), device, tp=tp)
        startup.lap("kv_cache_and_buffers")
        model_diffs = _model_differences(self.manifest, ex.loaded.fingerprint)
        if model_diffs:
            raise ManifestError(_mismatch_message(manifest_path(path), model_diffs))
        if ex.buffers.layout() != self.manifest.buffers:
            raise ManifestError(f"{manifest_path(path)}: the persistent buffer layout built here differs "
                                f"from the manifest's `buffers`. Recapture on this machine.")
        self.record_seconds = self._record()
        ex.runner.lock()
        self.broadcast = StepBroadcast(tp, ex, self.manifest.capture_order) if tp.active else None
        self.tokenizer = load_tokenizer(ex.loaded.checkpoint_dir, ex.loaded.config.vocab_size,
                                        ex.loaded.config.bos_token_id)
        self.chat_template = load_chat_template(ex.loaded.checkpoint_dir)
        self.generation = ex.loaded.generation  # generation_config.json: eos ids, sampling defaults
        self.stop_ids = set(ex.loaded.config.eos_token_ids) | set(self.generation.eos_token_ids)
        sp = config.speculative
        self.drafter = NgramDrafter(sp.draft_len, sp.ngram_min, sp.ngram_max) if sp and speculative else None
        self.scheduler = Scheduler(self.manifest.plan(), ex.num_blocks, ex.block_size, self.drafter,
                                   config.limits.max_seq_len)
        self.scheduler.pipelining = self.broadcast is None  # ranks follow one broadcast step at a time
        self.stats = RunStats(record_seconds=self.record_seconds)
        self._preemptions_before = 0  # the scheduler's count when `stats` began
        self._run_start: float | None = None  # when `stats` began counting seconds
        self._timing = False  # CUDA events around each step (generate(gpu_timing=True))
        self._live: dict[str, _Live] = {}  # requests being served, by id
        self._undelivered: list[RequestOutput] = []  # refusals, and outputs handed back
        self._aborts: set[str] = set()  # applied at the next step
        self._arrivals = 0  # requests added so far: each sequence's arrival order
        self._inflight: _InFlight | None = None  # a launched step whose tokens are not read yet
        self._last: tuple | None = None  # the last step's (key, rows) for the fast path
        self._choices: dict[str, list[Result | None]] = {}  # n > 1: finished completions by request
        pin = ex.device.type == "cuda"
        # Two pinned host buffer pairs used in turn: one step's tokens land while the other's are read.
        self._result_bufs = [(torch.zeros(ex.buffers.max_rows, dtype=torch.int64, pin_memory=pin),
                              torch.zeros(ex.buffers.max_seqs, dtype=torch.int64, pin_memory=pin))
                             for _ in range(2)]
        # Their twins for logprobs (values, ids), used in the same turn: nothing allocated per step.
        state = ex.buffers.state
        self._logprob_bufs = [tuple(torch.zeros(state[k].shape, dtype=state[k].dtype, pin_memory=pin)
                                    for k in ("logprob_values", "logprob_ids")) for _ in range(2)]
        self._result_turn = 0
        startup.lap("tokenizer_and_scheduler")

    @property
    def config(self):
        return self.executor.config

    # ---- start-up: re-record exactly the manifest's keys ----------------------------
    def _record(self) -> float:
        ex, t0 = self.executor, time.perf_counter()
        order = self.manifest.capture_order
        with torch.inference_mode():
            for key in order:
                ex.warmup(key)
            startup.lap("warmup_triton_cache")
            if self.eager:
                return time.perf_counter() - t0
            pool = 0
            for i, key in enumerate(order):
                agree(self.tp, f"graph key {i} and the buffer layout", f"{key}|{ex.buffers.layout()}")
                if ex.metadata[key].num_tokens != key.num_tokens:
                    raise ManifestError(f"{key}: token count {ex.metadata[key].num_tokens} != {key.num_tokens}")
                pool += ex.capture(key).pool_bytes
        startup.lap("re_record")
        expected = int(self.manifest.totals.get("pool_bytes", 0))
        if abs(pool - expected) > max(POOL_TOLERANCE_FRACTION * expected, POOL_TOLERANCE_BYTES):
            raise ManifestError(f"re-recorded graphs took {pool / 2**20:.1f} MiB of pool, the manifest says "
                                f"{expected / 2**20:.1f} MiB (tolerance 10% or 32 MiB). The machine or libraries "
                                f"behave differently from capture time; recapture here.")
        ex.num_eager_steps = 0
        return time.perf_counter() - t0

    # ---- requests ----------------------------------------------------------------------
    def _admit(self, req: Request, arrival: float) -> Sequence | Result:
        """A Sequence, or an error Result when no recorded key can serve the request. Sampling
        fields the request left out take the model's generation_config.json defaults."""
        req = resolve_sampling_defaults(req, self.generation)
        ids, fail = self._prompt_ids(req)
        if fail is None:
            fail = self._refusal(req, ids)
        if fail:
            return Result(id=req.id, finish_reason="error", error=fail, prompt_tokens=len(ids))
        seed = req.seed if req.seed is not None else secrets.randbits(62)
        return Sequence(request=req, arrival=arrival, prompt_ids=ids, seed=seed)

    def _sampling_refusal(self, req: Request) -> str | None:
        """Why this engine cannot serve the request's sampling fields exactly, or None."""
        s, cfg = req.sampling, self.executor.loaded.config
        if s.uses_penalties and self.drafter is not None:
            return ("repetition / presence / frequency penalties are not supported with speculative decoding "
                    "(draft tokens would count before they are accepted); run with speculative decoding off")
        if (s.logit_bias or s.min_tokens) and self.tp.active:
            return "logit_bias and min_tokens are not supported with tensor parallelism yet"
        if s.min_tokens and len(set(cfg.eos_token_ids) | set(s.stop_token_ids)) > MAX_STOP_IDS:
            return (f"min_tokens masks the EOS and stop token ids, at most {MAX_STOP_IDS} of them; this request "
                    f"has {len(set(cfg.eos_token_ids) | set(s.stop_token_ids))}")
        bad = [t for t, _ in s.logit_bias if t >= cfg.vocab_size]
        if bad:
            return f"logit_bias token id {bad[0]} is outside the vocabulary (size {cfg.vocab_size})"
        return None

    def _refusal(self, req: Request, ids: list[int]) -> str | None:
        """Why no recorded key can serve this prompt, or None."""
        cfg, lim = self.executor.loaded.config, self.config.limits
        if not ids:
            return "the prompt encodes to no tokens"
        if max(ids) >= cfg.vocab_size:
            return f"prompt token id {max(ids)} is outside the vocabulary (size {cfg.vocab_size})"
        if len(ids) + req.max_tokens > lim.max_seq_len:
            return (f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) = {len(ids) + req.max_tokens} "
                    f"exceeds the manifest's limits.max_seq_len ({lim.max_seq_len})")
        if not req.is_greedy and not self.scheduler_has_sampled:
            return ("temperature > 0, a logits processor or logprobs need sampled graphs, but this manifest "
                    "holds only greedy keys; recapture with buckets.sampling: [greedy, sampled], or send "
                    "temperature 0 without them")
        return self._sampling_refusal(req)

    def _prompt_ids(self, req: Request) -> tuple[list[int], str | None]:
        """The request's prompt as token ids: given, encoded text, or a chat rendered with the
        checkpoint's template. (ids, None) or ([], why not)."""
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids), None
        if req.messages is None:
            return self.tokenizer.encode(req.prompt), None
        if self.chat_template is None:
            where = self.executor.loaded.checkpoint_dir or "the synthetic model"
            return [], (f"{where} has no chat template (no `chat_template` in tokenizer_config.json and no "
                        f"chat_template.jinja), so it cannot serve `messages`; send `prompt` text instead")
        try:
            text = self.chat_template.render(req.chat_messages, add_generation_prompt=True)
        except PromptError as exc:
            return [], str(exc)
        return self.tokenizer.encode(text, add_special_tokens=False), None

    @property
    def scheduler_has_sampled(self) -> bool:
        return "sampled" in {k.sampling for k in self.manifest.graph_keys}

    # ---- the incremental core: add, abort, step -----------------------------------------
    def add_request(self, request: Request | dict, where: str = "request") -> None:
        """Queue a request; it joins the running batch at a coming step. A request no
        recorded key can serve comes back from the next step() as an error Result. Raises
        PromptError for a malformed dict or an id that is already live."""
        req = request if isinstance(request, Request) else parse_request(
            request, where, self.executor.loaded.config.vocab_size)
        if self._is_live(req.id):
            raise PromptError(f"{where}: duplicate id {req.id!r}: a request with that id is still being "
                              f"served; ids must be unique, results are keyed by them.")
        if not self.has_unfinished():
            self.executor.runner.check_weights()
        if self._run_start is None:
            self._run_start = time.perf_counter()
        self._arrivals += 1
        self.stats.requests += 1
        item = self._admit(req, self._arrivals)
        if isinstance(item, Result):
            self.stats.refused += 1
            self._undelivered.append(RequestOutput(req.id, finished=True, finish_reason="error", result=item))
            return
        self.stats.prompt_tokens += len(item.prompt_ids)
        self._live[req.id] = _Live(item, time.perf_counter(), TextStream(self.tokenizer, req.stop_strings))
        self.scheduler.add(item)

    def _is_live(self, request_id: str) -> bool:
        """Being served, or finished with its last output not yet handed out."""
        return request_id in self._live or any(o.id == request_id for o in self._undelivered)

    def abort(self, request_id: str) -> bool:
        """Stop serving a live request at the next step: it leaves the scheduler, its KV
        blocks are freed, and no more outputs come for it. False if it is not live."""
        if not self._is_live(request_id):
            return False
        self._aborts.add(request_id)
        return True

    def has_unfinished(self) -> bool:
        """Whether step() has anything left to do or hand out."""
        return bool(self._live or self._undelivered or self._inflight is not None)

    def step(self) -> list[RequestOutput]:
        """Advance by one step: apply aborts, launch a step if none is in flight (and, in
        steady decoding, the next one before reading this one's tokens), read its tokens
        back. Returns every request's news: outputs handed back by other consumers first,
        then refusals, then this step's."""
        self._apply_aborts()
        outputs, self._undelivered = self._undelivered, []
        with torch.inference_mode():
            if self._inflight is None:
                self._inflight = self._launch_next()
            if self._inflight is not None:
                f = self._inflight
                # Overlap: while the device runs this decode step, launch the next one (same
                # rows, inputs advanced on the device) before reading this one's tokens back.
                self._inflight = (self._launch(f.step, ahead=1) if self.scheduler.extend_decode(f.step)
                                  else None)
                outputs += self._complete(f)
                if self._inflight is not None and all(s.finished for s in self._inflight.step.seqs):
                    self._complete(self._inflight)  # ran ahead for rows that all finished: drain it
                    self._inflight = None
        self.stats.preemptions = self.scheduler.num_preemptions - self._preemptions_before
        if self._run_start is not None:
            self.stats.seconds = time.perf_counter() - self._run_start
        return outputs

    def hand_back(self, outputs: list[RequestOutput]) -> None:
        """Outputs a consumer took from step() that belong to another consumer's requests:
        the next step() returns them first."""
        self._undelivered = list(outputs) + self._undelivered

    def outputs_of(self, ids: Iterable[str]) -> Iterator[RequestOutput]:
        """Step until every request in `ids` has finished, yielding their outputs as they
        come and handing every other request's back for its own consumer."""
        remaining = set(ids)
        while remaining:
            outputs = self.step()
            self.hand_back([o for o in outputs if o.id not in remaining])
            for out in outputs:
                if out.id in remaining:
                    if out.finished:
                        remaining.discard(out.id)
                    yield out

    def generate(self, requests: Iterable[Request | dict], gpu_timing: bool = False) -> Iterator[Result]:
        """Serve `requests`; yield each Result as soon as it finishes (refusals first).
        gpu_timing: record CUDA events around every step to report the GPU's idle time."""
        ids = self.submit(requests, gpu_timing)
        for out in self.outputs_of(ids):
            if out.finished:
                yield out.result

    def submit(self, requests: Iterable[Request | dict], gpu_timing: bool = False) -> list[str]:
        """Validate every request (ids unique within the batch and among live requests),
        then queue them all; their ids. Submitted to an idle engine they start a new run:
        `stats` then cover this batch (and whatever joins it before the engine is idle)."""
        vocab = self.executor.loaded.config.vocab_size
        reqs = [r if isinstance(r, Request) else parse_request(r, f"request {i}", vocab)
                for i, r in enumerate(requests)]
        first: dict[str, int] = {}
        for i, r in enumerate(reqs):
            if r.id in first:
                raise PromptError(f"request {i}: duplicate id {r.id!r} (first at request {first[r.id]}); "
                                  f"ids must be unique, results are keyed by them.")
            if self._is_live(r.id):
                raise PromptError(f"request {i}: duplicate id {r.id!r}: a request with that id is still being "
                                  f"served; ids must be unique, results are keyed by them.")
            first[r.id] = i
        if not self.has_unfinished():
            self.start_run(gpu_timing)
        for i, req in enumerate(reqs):
            self.add_request(req, f"request {i}")
        return list(first)

    def start_run(self, gpu_timing: bool = False) -> None:
        """Fresh stats, from now on (an idle engine only; submit() and generate() start one
        when the engine is idle, so what they report covers their own call). gpu_timing:
        CUDA events around every step, for the GPU's idle time."""
        if self.has_unfinished():
            raise RuntimeError("start_run() on an engine that is still serving requests")
        self.stats = RunStats(record_seconds=self.record_seconds)
        self._preemptions_before = self.scheduler.num_preemptions
        self._run_start = time.perf_counter()
        self._timing = gpu_timing and self.executor.device.type == "cuda"
        if self._timing:
            self.stats.gpu_busy_seconds = 0.0

    def _apply_aborts(self) -> None:
        sched = self.scheduler
        for rid in self._aborts:
            live = self._live.pop(rid, None)
            if live is None:  # finished; its last output is dropped below
                continue
            self.stats.aborted += 1
            self._choices.pop(rid, None)
            # the request's sequence, and with n > 1 every completion forked from it
            seqs = [live.seq] + [s for s in (*sched.running, *sched.waiting)
                                 if s.request is live.seq.request and s is not live.seq]
            for seq in seqs:
                if seq.finished:
                    continue
                if seq in sched.running:
                    sched.finish(seq)
                else:  # waiting: it holds no blocks
                    sched.waiting.remove(seq)
                    seq.finished = True
        if self._aborts:
            self._undelivered = [o for o in self._undelivered if o.id not in self._aborts]
            self._aborts.clear()

    def _launch_next(self) -> "_InFlight | None":
        """Form and launch a step; None when nothing is left to run."""
        while self.scheduler.has_work:
            step = self.scheduler.schedule()
            if step is not None:  # None: every running row stepped aside this time; they wait now
                return self._launch(step)
        return None

    def follow(self) -> int:
        """Ranks other than 0: replay every step rank 0 broadcasts, until it closes."""
        return self.broadcast.follow(self.eager)

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop following."""
        if self.broadcast is not None:
            self.broadcast.stop()

    # ---- one step ------------------------------------------------------------------------
    def _launch(self, step: ScheduledStep, ahead: int = 0) -> "_InFlight":
        """Prepare and enqueue a step, and the non-blocking copy of its tokens to the host.
        `ahead`: tokens the step's rows are beyond what the scheduler has accounted."""
        ex, stats = self.executor, self.stats
        if self.broadcast is not None:  # the other ranks get the full inputs every step
            self._last = None
        self._last = self._prepare(step, self._last, ahead)
        if self.broadcast is not None:
            self.broadcast.send(step.key)
        events = None
        if self._timing:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        out = ex.execute(step.key, eager=self.eager)
        if events:
            events[1].record()
        n = len(step.seqs)
        rows = n if step.is_prefill else n * step.key.q_len  # logit rows of the real sequences
        host, host_accepted = self._host_buffers()
        host[:rows].copy_(out.tokens[:rows], non_blocking=True)
        if step.drafts is not None:
            host_accepted[:n].copy_(out.accepted[:n], non_blocking=True)
            stats.verify_steps += 1
            stats.verify_rows += n
            stats.drafted_rows += step.num_proposed
            stats.drafts_fed += n * step.key.draft_len
        logprobs = None
        if out.logprob_values is not None and any(q.request.logprobs is not None for q in step.seqs):
            # copied now (a step launched ahead rewrites the device buffers), into this turn's host pair
            logprobs = tuple(h[:rows].copy_(t[:rows], non_blocking=True)
                             for h, t in zip(self._logprob_bufs[self._result_turn], (out.logprob_values, out.logprob_ids)))
        done = torch.cuda.Event() if ex.device.type == "cuda" else None
        if done is not None:
            done.record()
        stats.steps += 1
        stats.steps_per_key[step.key] += 1
        stats.real_tokens += sum(step.num_new)
        stats.padded_tokens += step.key.num_tokens
        return _InFlight(step, host[:rows], host_accepted[:n] if step.drafts is not None else None, done, events,
                         logprobs)

    def _host_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        self._result_turn ^= 1
        return self._result_bufs[self._result_turn]

    def _complete(self, f: "_InFlight") -> list[RequestOutput]:
        """Wait for a step's tokens, account them, and return each drawing request's news."""
        if f.done is not None:
            f.done.synchronize()
        if f.events:
            self.stats.gpu_busy_seconds += f.events[0].elapsed_time(f.events[1]) / 1e3
        accepted = f.accepted.tolist() if f.accepted is not None else None
        if accepted is not None:
            self.stats.drafts_accepted += sum(accepted)
            self.stats.verify_tokens += sum(accepted) + len(accepted)
        drew = self.scheduler.advance(f.step, f.tokens.tolist(), accepted)
        if f.logprobs is not None:
            self._keep_logprobs(f, drew)
        outputs = []
        for seq, n_new in drew:
            self._fork(seq)
            live = self._live[seq.request.id]
            result = self._check_stop(seq, n_new, live.arrival_seconds)
            if seq.request.n > 1:  # one output, once all n completions have finished
                if result is not None:
                    outputs += self._finish_choice(seq, result)
                continue
            if result is None:
                out = seq.output_ids
                outputs.append(RequestOutput(seq.request.id, out[live.num_sent:], live.text.feed(out)))
                live.num_sent = len(out)
                continue
            self.scheduler.finish(seq)
            del self._live[seq.request.id]
            self.stats.completion_tokens += len(result.token_ids)
            outputs.append(RequestOutput(result.id, result.token_ids[live.num_sent:], live.text.finish(result.text),
                                         True, result.finish_reason, result))
        return outputs

    def _finish_choice(self, seq: Sequence, result: Result) -> list[RequestOutput]:
        """n > 1: one completion finished; the request's output once all n have."""
        self.scheduler.finish(seq)
        self.stats.completion_tokens += len(result.token_ids)
        result = self._gather(seq, result)
        if result is None:
            return []
        del self._live[seq.request.id]
        return [RequestOutput(result.id, [], "", True, result.finish_reason, result)]

    # ---- n > 1: fork after the prompt, gather the n completions -------------------------
    def _fork(self, seq: Sequence) -> None:
        """When completion 0 of an n > 1 request has drawn its first token (its prompt is in
        the cache), start completions 1..n-1; completion i draws with seed + i (mod 2**63)."""
        req = seq.request
        if req.n == 1 or req.id in self._choices:
            return
        self._choices[req.id] = [None] * req.n
        self.scheduler.fork(seq, [(seq.seed + i) % (1 << 63) for i in range(1, req.n)])

    def _gather(self, seq: Sequence, result: Result) -> Result | None:
        """n > 1: hold each finished completion until all n have; then one Result carrying
        them as `choices`."""
        if seq.request.n == 1:
            return result
        slots = self._choices[seq.request.id]
        slots[seq.index] = result
        if any(r is None for r in slots):
            return None
        del self._choices[seq.request.id]
        return Result(id=result.id, prompt_tokens=result.prompt_tokens, choices=slots,
                      finish_reason=slots[0].finish_reason, ttft_ms=min(r.ttft_ms for r in slots))

    def _prepare(self, step: ScheduledStep, last: tuple | None, ahead: int = 0) -> tuple:
        """Fast path when the same generation rows repeat in the same order; otherwise
        pack on the host and copy once. Returns what the next step compares against."""
        ex = self.executor
        ids = tuple(id(s) for s in step.seqs)
        plain_decode = not step.is_prefill and step.drafts is None
        if plain_decode and last == (step.key, ids):
            new_blocks = []
            for row, seq in enumerate(step.seqs):
                pos = seq.num_computed + ahead  # the position this step's token takes
                if pos % ex.block_size == 0:
                    new_blocks.append((row, pos // ex.block_size, seq.block_table[pos // ex.block_size]))
            ex.advance_decode(len(step.seqs), new_blocks)
            self.stats.fast_path_steps += 1
        else:
            assert ahead == 0, "a step launched ahead must be on the fast path"
            for seq in step.seqs:  # a sequence entering its slot: its tables replace the last occupant's
                if step.is_prefill and seq.num_computed == 0 and seq.request.sampling.uses_processors:
                    ex.buffers.write_slot(seq.slot, seq.request.logit_bias, self._masked_ids(seq.request))
            drafts = step.drafts or [None] * len(step.seqs)
            ex.prepare(step.key, [self._row(seq, n, d) for seq, n, d in zip(step.seqs, step.num_new, drafts)])
        return (step.key, ids) if plain_decode else None

    def _masked_ids(self, req: Request) -> list[int]:
        """What min_tokens masks: the model's EOS ids and the request's stop ids."""
        return sorted(set(self.executor.loaded.config.eos_token_ids) | set(req.stop_token_ids))

    @staticmethod
    def _row(seq: Sequence, n: int, drafts: list[int] | None = None) -> StepRow:
        r, s = seq.request, seq.request.sampling
        fed = seq.all_ids[seq.num_computed:seq.num_computed + n] if drafts is None else [seq.all_ids[-1]] + drafts
        prompt_len = len(seq.prompt_ids)
        return StepRow(token_ids=fed, start_pos=seq.num_computed,
                       block_table=seq.block_table, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                       seed=seq.seed, min_p=s.min_p, processors=s.uses_processors,
                       slot=seq.slot if s.uses_processors else None,
                       counted=seq.num_computed + len(fed) >= len(seq.all_ids), prompt_len=prompt_len,
                       eos_until=prompt_len + s.min_tokens if s.min_tokens else 0,
                       repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
                       frequency_penalty=s.frequency_penalty, logprobs=s.logprobs is not None)

    def _check_stop(self, seq: Sequence, n_new: int, start: float) -> Result | None:
        """Check the `n_new` tokens just appended, in order; at a stop, drop what follows."""
        req, out = seq.request, seq.output_ids
        reason, cut = None, len(out)
        for j in range(len(out) - n_new, len(out)):
            stops = j + 1 >= req.min_tokens and (out[j] in req.stop_token_ids
                                                 or (out[j] in self.stop_ids and not req.ignore_eos))
            if stops:
                reason, cut = "stop", j + 1
                break
            if j + 1 >= req.max_tokens:
                reason, cut = "length", j + 1
                break
        out = out[:cut]
        text = None
        if req.stop_strings and len(out) >= req.min_tokens:
            text = self.tokenizer.decode(out)
            hit = min((text.find(s) for s in req.stop_strings if s in text), default=-1)
            if hit >= 0:
                reason, text = "stop", text[:hit]
        if reason is None:
            return None
        if cut < len(seq.output_ids):  # a verify step ran past the stop
            del seq.all_ids[len(seq.prompt_ids) + cut:]
        if text is None:
            text = self.tokenizer.decode(out)
        n = len(out)
        tpot = (seq.last_token_time - seq.first_token_time) * 1e3 / (n - 1) if n > 1 else None
        logprobs = self._logprob_entries(seq, len(out)) if req.logprobs is not None else None
        return Result(id=req.id, text=text, token_ids=list(out), finish_reason=reason,
                      prompt_tokens=len(seq.prompt_ids), ttft_ms=(seq.first_token_time - start) * 1e3, tpot_ms=tpot,
                      logprobs=logprobs)

    # ---- logprobs ------------------------------------------------------------------------
    @staticmethod
    def _keep_logprobs(f: "_InFlight", drew: list) -> None:
        """Each drawing sequence's rows of the step's log-probabilities, in token order."""
        values, ids = f.logprobs
        q = 1 if f.step.is_prefill else f.step.key.q_len
        row_of = {id(seq): i * q for i, seq in enumerate(f.step.seqs)}
        for seq, n_new in drew:
            if seq.request.logprobs is not None:
                r = row_of[id(seq)]
                seq.logprobs += [(values[r + j].tolist(), ids[r + j].tolist()) for j in range(n_new)]

    def _logprob_entries(self, seq: Sequence, n: int) -> list[dict]:
        """One entry per generated token (runtime/serving/requests.py documents the shape)."""
        k, dec = seq.request.logprobs, self.tokenizer.decode
        out = []
        for token, (values, ids) in zip(seq.output_ids[:n], seq.logprobs[:n]):
            out.append({"token_id": token, "token": dec([token]), "logprob": values[0],
                        "top_logprobs": [{"token_id": t, "token": dec([t]), "logprob": v}
                                         for t, v in zip(ids[:k], values[1:k + 1])]})
        return out


@dataclass
class _Live:
    """A request being served: its sequence, when it arrived, and what was handed out."""
    seq: Sequence
    arrival_seconds: float  # time.perf_counter() at add_request
    text: TextStream
    num_sent: int = 0  # output tokens already handed out


@dataclass
class _InFlight:
    step: ScheduledStep
    tokens: torch.Tensor  # host view the step's tokens are copied into
    accepted: torch.Tensor | None  # verify steps: host view of the accepted counts
    done: object  # CUDA event recorded after that copy (None on a CPU)
    events: tuple | None  # (begin, end) around the replay, with gpu_timing
    logprobs: tuple | None = None  # (values [rows, 1 + K], ids [rows, K]) on the host, when a row asked


def _with_checkpoint(config, mpath: Path, model: str | Path | None):
    """The manifest's config, with the checkpoint at `model` when given. A checkpoint directory
    that is gone is refused here, naming the field and the option that points elsewhere."""
    from ...config import ModelSource

    if model is not None:
        ckpt = Path(model).expanduser()
        if not ckpt.is_dir():
            raise ManifestError(f"--model {model}: no such checkpoint directory. Pass the directory that holds "
                                f"the checkpoint captured into {mpath}.")
        return config.replace(model=ModelSource(path=str(ckpt.resolve())))
    if config.model.path is not None and not Path(config.model.path).is_dir():
        raise ManifestError(f"{mpath}: config.model.path = {config.model.path} does not exist; the checkpoint "
                            f"was moved or deleted after capture. Pass its new location with `trtgraph run "
                            f"--model PATH` (or LLM(..., model=PATH)); its files are checked against the "
                            f"manifest's sizes and sha256.")
    return config


def _model_differences(manifest, fingerprint: dict):
    from ...artifacts import compare_model
    from ..step.checks import Difference

    return [Difference(*d) for d in compare_model(manifest, fingerprint)]


def _mismatch_message(path: Path, diffs) -> str:
    return (f"{path}: this manifest does not match this machine: " + "; ".join(str(d) for d in diffs)
            + f". Recapture here with `trtgraph capture --config <your model.yaml> --out {path.parent}`.")
