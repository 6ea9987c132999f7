"""The executor: model, paged KV cache, persistent buffers, per-key metadata and the graph
runner, wired once. `capture` (used by the compiler and at runtime start-up) records a
key; `prepare` writes one step's inputs (padding included) into the buffers; `execute`
replays the key's graph, or runs the same step eagerly for A/B checks. Input preparation
(full and fast path) lives in `inputs.py`.

The compiler and the runtime build exactly this object, so what was verified at capture
is what serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from ...buckets import GREEDY, BucketPlan, GraphKey
from ...config import AUTO, Config
from ...errors import ConfigError, ReplayMismatchError
from ...kernels import get_kernels
from ...kernels import resolve as resolve_kernels
from ...models import DTYPES, LoadedModel, load_model
from ...models.parallel import TPGroup
from ...kernels import sampler_reference as sampler
from ...kernels.advance import choose as choose_advance
from .buffers import StepBuffers
from .cuda_graph import graph_time_us
from .graph_runner import CaptureStats, GraphRunner
from .inputs import StepInputs, StepRow, advances  # noqa: F401 (StepRow: callers import it from here)
from .kv_cache import allocate_kv_caches, auto_num_blocks, blocks_for_tokens
from .metadata import AttentionMetadata


def linear_timer(device: torch.device):
    """The GEMM backends' timer at capture (kernels.linear.choose_backends): GPU time of a replayed
    graph on CUDA; none elsewhere (cuBLAS is not allowed off CUDA, so nothing is timed)."""
    return partial(graph_time_us, device=device) if device.type == "cuda" else None


@dataclass
class StepOutputs:
    """A step's outputs, graph-owned (read before the next step). Greedy keys write no logits:
    their LM head writes the tokens alone; `Executor.logits` computes a step's logits from its
    head input (`hidden`, `normed`) where they are wanted (verification, tests)."""
    logits: torch.Tensor | None  # [R, V] fp32 (sampled keys; None for greedy keys)
    tokens: torch.Tensor  # [R] int64, on the device
    accepted: torch.Tensor  # [B] int64: drafts accepted per row (verify keys; other keys leave it stale)
    logprob_values: torch.Tensor | None = None  # [R, 1 + K] fp32 (sampled keys; rows that asked)
    logprob_ids: torch.Tensor | None = None  # [R, K] int64
    hidden: torch.Tensor | None = None  # [R, H]: the LM head's input rows (the residual stream's)
    normed: torch.Tensor | None = None  # [R, H]: their final norm where the step hoisted it (else None)


def resolve_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name == AUTO and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("device = 'cuda' but no CUDA device is available here; use "
                              "`--device cpu` (static backend) or run on a GPU machine.")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "cuda" if device.type == "cuda" else "static"


@dataclass
class Executor(StepInputs):
    config: Config
    plan: BucketPlan
    loaded: LoadedModel
    device: torch.device
    num_blocks: int
    kv_caches: list = field(init=False)
    buffers: StepBuffers = field(init=False)
    runner: GraphRunner = field(init=False)
    metadata: dict = field(init=False)
    num_eager_steps: int = 0
    closed: bool = False

    def __post_init__(self):
        cfg, lim = self.model.local, self.config.limits  # this rank's KV heads
        self.block_size = self.config.kv_cache.block_size
        self.max_blocks_per_seq = blocks_for_tokens(lim.max_seq_len, self.block_size)
        self.kv_caches = allocate_kv_caches(cfg, self.num_blocks, self.block_size, DTYPES[self.config.dtype],
                                            self.device)
        keys = self.plan.keys
        self.buffers = StepBuffers(
            max_tokens=max(k.num_tokens for k in keys),
            max_seqs=max(k.batch_size for k in keys),
            max_rows=max(k.num_logit_rows for k in keys),
            max_blocks_per_seq=self.max_blocks_per_seq,
            device=self.device,
            vocab_size=self.model.cfg.vocab_size,
            num_slots=self.plan.max_batch_size,
        )
        pin = self.device.type == "cuda"
        # the fast path's new block entries (a count, then (row, column, block) each), staged in turn
        self._new_blocks_host = [torch.zeros(self.buffers.new_blocks.shape, dtype=torch.int64, pin_memory=pin)
                                 for _ in range(3)]
        self._new_blocks_turn = 0
        self.runner = GraphRunner(backend_for(self.device), self.device, self.persistent_tensors, self.weight_tensors)
        self.metadata = {k: AttentionMetadata(
            q_len=k.q_len, batch_size=k.batch_size,
            slot_mapping=self.buffers.dev.slot_mapping[:k.num_tokens],
            block_tables=self.buffers.dev.block_tables[:k.batch_size],
            kv_caches=self.kv_caches) for k in keys}

    @classmethod
    def build(cls, config: Config, plan: BucketPlan, device: torch.device | None = None,
              loaded: LoadedModel | None = None, tp: TPGroup = TPGroup(), *,
              linear_record: dict[str, str] | None = None, from_manifest: bool = False) -> "Executor":
        """With tensor parallelism (tp.world > 1), this rank's shard of the model and cache.
        `from_manifest`: a start from a manifest, which installs its GEMM backends (`linear_record`,
        totals.linear_backends) rather than timing them again (a manifest without the record: the
        choice without timing, as captures before the timing made it)."""
        device = device or resolve_device(config.device)
        if loaded is None:
            kernels = get_kernels(resolve_kernels(config.kernels, device.type))
            loaded = load_model(config.model, config.dtype, device, config.limits.max_seq_len, kernels, tp)
        if loaded.model.ops.name == "triton":  # GEMM backends, fused GEMVs, attention splits, invariant where asked
            from ...kernels.decode_linear import choose_fused
            from ...kernels.linear import choose_backends, runs_cublas
            from ...kernels.split_residual import choose_split
            from ...kernels.attention import set_attention_invariant

            set_attention_invariant(config.deterministic)

            counts = loaded.model.linear_row_counts([k.num_tokens for k in plan.keys],
                                                    [k.num_logit_rows for k in plan.keys])
            first = loaded.model.layers[0]  # o and down also run linear_residual's GEMM + residual add
            choose_backends(counts, DTYPES[config.dtype], device, config.deterministic, frozenset(
                tuple(w.shape) for w in (first.self_attn.o_proj.weight, first.mlp.down_proj.weight)),
                timer=None if from_manifest or tp.active else linear_timer(device),  # ranks must pick alike
                recorded=linear_record)
            # the fused decode GEMVs: which (op, weight shape) runs them for steps of few rows
            shapes = [(op, *w.shape) for op, w in (
                ("norm_qkv_rope", first.self_attn.qkv_proj.weight), ("linear_residual", first.self_attn.o_proj.weight),
                ("norm_gate_up_silu", first.mlp.gate_up_proj.weight), ("linear_residual", first.mlp.down_proj.weight),
                ("norm_linear", loaded.model.lm_head_weight))]
            choose_fused(shapes, counts, device, config.deterministic, loaded.model.tp.active,
                         qk_norm=loaded.model.local.qk_norm, dtype=DTYPES[config.dtype])
            # the down projection at 17-64 rows with the next norm: partials + one sum / residual / norm kernel
            down = tuple(first.mlp.down_proj.weight.shape)
            choose_split(down, counts[down], lambda m: runs_cublas(down, m), device,
                         config.deterministic, loaded.model.tp.active, DTYPES[config.dtype])
        lim = config.limits
        num_blocks = config.kv_cache.num_blocks
        if num_blocks == AUTO:
            num_blocks = auto_num_blocks(loaded.model.local, config.kv_cache.block_size, DTYPES[config.dtype], device,
                                         lim.max_batch_size, lim.max_seq_len)
        return cls(config=config, plan=plan, loaded=loaded, device=device, num_blocks=num_blocks)

    def close(self) -> None:
        """Give back what was built on the device: the device waits for the work queued on it,
        then the graphs are destroyed (GraphRunner.close) and the KV cache, the step buffers, the
        per-key metadata and the model (weights) dropped, so nothing of them is left referenced here
        (their memory returns to torch's allocator at once, without the cyclic collector). Idempotent;
        a closed executor serves nothing (Engine.close)."""
        if self.closed:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay or copy may still use what is freed below
        self.runner.close()
        self.metadata, self.kv_caches, self.buffers, self._new_blocks_host = {}, [], None, []
        self.loaded = None
        self.closed = True

    @property
    def model(self):
        return self.loaded.model

    @property
    def tp(self) -> TPGroup:
        return self.model.tp

    @property
    def backend(self) -> str:
        return self.runner.backend

    def persistent_tensors(self) -> dict[str, torch.Tensor]:
        """What every replay checks: the step buffers, the KV caches and the rope table."""
        out = dict(self.buffers.tensors())
        out.update({f"kv_cache.{i}": t for i, t in enumerate(self.kv_caches)})
        out["cos_sin"] = self.model.cos_sin
        return out

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """The model's parameters: checked at every capture and at the start of every
        generate() (walking ~150 parameters per replay would cost more than a small step)."""
        return {f"weight.{n}": p for n, p in self.model.named_parameters()}

    # ---- the step ------------------------------------------------------------------
    def step_fn(self, key: GraphKey):
        """The closure a graph records: (decode keys) the advance of the inputs, model forward,
        logits, sampler, over buffer views."""
        model, bufs, meta = self.model, self.buffers, self.metadata[key]
        T, B, R = key.num_tokens, key.batch_size, key.num_logit_rows
        ids, pos = bufs.dev.input_ids[:T], bufs.dev.positions[:T]
        rows = bufs.dev.logits_indices[:B]
        out, accepted = bufs.next_tokens[:R], bufs.accepted[:B]
        q = key.q_len
        draw = self._sampled_draw(key) if key.sampling != GREEDY else None
        advance = self._advance_fn(key) if advances(key) else None

        def step():
            if advance is not None:
                advance()  # this step's inputs from what the last replay left (kernels/advance.py)
            hidden, normed = model.forward_normed(ids, pos, meta)  # [T, H]; the final norm where hoisted
            if key.is_prefill:
                hidden, normed = hidden.index_select(0, rows), None  # [B, H]: each sequence's last real token
            if draw is None:  # greedy: the LM head writes the tokens' buffer itself (its epilogue's argmax), no logits
                logits, tokens = model.greedy_tokens(hidden, normed, out), out
            else:
                logits = model.compute_logits(hidden, normed)  # [R, V]
                tokens = out.copy_(draw(logits))
            if key.draft_len:
                # Verification: row i's token j is the model's own draw after its first j+1
                # inputs; draft j+1 stands iff it equals that draw. Accepted = the longest
                # run of matches. Sampled keys draw with the same seeded noise as plain
                # decoding, so a draft is accepted with probability p(draft) and the output
                # is token for token what plain sampling would give.
                match = ids.view(B, q)[:, 1:] == tokens.view(B, q)[:, :-1]
                accepted.copy_(match.to(torch.int64).cumprod(dim=1).sum(dim=1))
            return logits, out, accepted, hidden, normed

        return step

    def _advance_fn(self, key: GraphKey):
        """A decode key's first op: FRESH inputs (gathered rows take the drawn tokens), ADVANCE
        (the fast path: one position on, the staged new blocks) or AS_IS, by `control`."""
        d, B, bs = self.buffers.dev, key.batch_size, self.block_size
        op = choose_advance(self.model.ops.name)
        args = (d.control, self.buffers.new_blocks, d.input_ids[:B], d.positions[:B], d.slot_mapping[:B],
                d.block_tables[:B], d.gather_src[:B], self.buffers.next_tokens)
        return lambda: op(*args, bs)

    def _sampled_draw(self, key: GraphKey):
        """The sampled keys' draw: processors, filters, Gumbel-max, the token counts and the
        log-probabilities, through the model's KernelSet."""
        ops, d = self.model.ops, self.buffers.dev
        T, B, R, q = key.num_tokens, key.batch_size, key.num_logit_rows, key.q_len
        ids, pos, last = d.input_ids[:T], d.positions[:T], d.logits_indices[:B]
        temperature, top_k, top_p, seeds, min_p = d.temperature[:R], d.top_k[:R], d.top_p[:R], d.seeds[:R], d.min_p[:R]
        slots, count_slots, prompt_lens, want_logprobs = d.slots[:R], d.count_slots[:R], d.prompt_lens[:R], d.logprobs[:R]
        params = sampler.RowParams(active=d.processors[:R], slots=slots, eos_until=d.eos_until[:R],
                                   repetition=d.repetition_penalty[:R], presence=d.presence_penalty[:R],
                                   frequency=d.frequency_penalty[:R])
        st = self.buffers.state
        state = sampler.SlotState(st["token_counts"], st["bias_ids"], st["bias_values"], st["stop_ids"])
        lp_vals, lp_ids = st["logprob_values"][:R], st["logprob_ids"][:R]
        k = lp_ids.shape[1]

        def draw(logits):
            draw_pos = (pos.index_select(0, last) if key.is_prefill else pos) + 1
            if key.is_prefill:  # the fed tokens of sequences with a slot: prompt bits and generated counts
                sampler.scan_prompt(state, slots, prompt_lens, ids, pos, last, q)
            processed = ops.process_logits(logits, params, state, draw_pos)
            tokens = ops.sample(logits, temperature, top_k, top_p, seeds, draw_pos, min_p, processed, params.active)
            if not key.draft_len:
                sampler.count_tokens(state, count_slots, tokens)
            vals, top = ops.top_logprobs(logits, tokens, want_logprobs, k)
            lp_vals.copy_(vals)
            lp_ids.copy_(top)
            return tokens

        return draw

    def warmup(self, key: GraphKey) -> None:
        """One eager run on padding-only inputs: lazy library state and workspaces reach
        their size before any capture. A greedy key's head also runs as `logits` runs it (the
        capture's warm-up of the key, its verification reference, runs that too: the kernels
        and buffers it judges a key by include it, so a start that warms the key must make them)."""
        self.prepare(key, [])
        logits, _, _, hidden, normed = self.step_fn(key)()
        if logits is None:
            self.model.compute_logits(hidden, normed)
        self.inputs_used()

    def capture(self, key: GraphKey) -> CaptureStats:
        self.prepare(key, [])  # padding-only inputs: the capture run must not touch real blocks
        stats = self.runner.capture(key, self.step_fn(key), self.metadata[key])
        self.inputs_used()
        return stats

    def execute(self, key: GraphKey, eager: bool = False) -> StepOutputs:
        """Replay `key` (or run it eagerly) on the inputs `prepare` or `advance_decode` set;
        executed again without either, a decode key runs on the inputs as they are (AS_IS)."""
        pos = self.buffers.dev.positions[:key.num_tokens]
        if key not in self.metadata:
            raise ReplayMismatchError(f"{key} is not in this executor's bucket plan; planned keys: "
                                      f"{', '.join(str(k) for k in self.plan.keys)}")
        self.before_execute(key)
        if eager:
            self.num_eager_steps += 1
            logits, tokens, accepted, hidden, normed = self.step_fn(key)()
        else:
            logits, tokens, accepted, hidden, normed = self.runner.replay(key, self.metadata[key], key.num_tokens, pos)
        if key.sampling == GREEDY:
            return StepOutputs(logits, tokens, accepted, hidden=hidden, normed=normed)
        st, R = self.buffers.state, key.num_logit_rows
        return StepOutputs(logits, tokens, accepted, st["logprob_values"][:R], st["logprob_ids"][:R], hidden, normed)

    def logits(self, out: StepOutputs) -> torch.Tensor:
        """A step's fp32 logits [R, V]: a sampled key's own, or (greedy keys, which write none)
        the LM head run again, eagerly, on the step's head input: the values the step's head
        would have stored where the plain head runs the greedy head's kernel (the same
        accumulator, or the same composition; every LM-head shape today: the one-row light kernel,
        which the greedy head never takes, is installed for layer shapes only). Read before the
        next step, as the outputs are; with tensor parallelism every rank must call it."""
        return out.logits if out.logits is not None else self.model.compute_logits(out.hidden, out.normed)
