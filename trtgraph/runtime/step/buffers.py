"""Persistent step buffers: allocated once from the limits, never re-allocated.

Every graph reads its inputs from views at offset 0 of these tensors. All per-step integer
metadata lives in one int64 tensor (`ints`) and the float sampling parameters in one fp32
tensor (`floats`), both views of one byte tensor (`raw`) with a host staging twin (pinned on
CUDA), so a step's inputs cross to the device in one copy. The staging is one slot (the runtime), or a ring of slots
(`stage_slots`: the capture, whose verification and timing runs queue many steps ahead of the
device): each upload leaves from the next slot, which starts as a copy of the last, so a write
waits only for the upload that slot made a ring ago. `dev` and `host` name every field
(`StepFields`, views made once). `next_tokens` holds the last step's drawn tokens on the device, where the
steady-state fast path gathers the next inputs from: inside the decode keys' graphs, driven by
`control` (FRESH / ADVANCE / AS_IS) and the staged `new_blocks` (kernels/advance.py).

Per-sequence sampling state lives by slot (`Sequence.slot`; the last slot is scratch for
rows that use no processor, and for padding): `token_counts` [slots + 1, V] int32 (generated
count, bit 24 = "in the prompt"), written inside the graphs; `bias_ids` / `bias_values` and
`stop_ids`, written once when a sequence that uses them enters its slot (`write_slot`).
`logprob_values` [rows, 1 + MAX_LOGPROBS] / `logprob_ids` [rows, MAX_LOGPROBS] hold each
row's log-probabilities, read back only when a row asked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from ...kernels.advance import ADVANCE, AS_IS, FRESH  # noqa: F401 (re-exported: the runtime's names)
from ...limits import LOGIT_BIAS_CAPACITY, MAX_LOGPROBS, MAX_STOP_IDS

View = torch.Tensor | np.ndarray  # a device tensor (StepBuffers.dev) or a host staging view (StepBuffers.host)


def _packed(size: str, group: str = "ints"):
    """A field of the packed storage: `group` (ints: int64, floats: fp32) and the limit that
    sizes it: "tokens" (max tokens), "rows" (max logit rows), "seqs" (max batch size),
    "table" (max batch size x blocks per sequence, viewed [seqs, blocks per sequence]),
    "control" (the decode keys' advance: CONTROL_SIZE values)."""
    return field(metadata={"size": size, "group": group})


@dataclass(frozen=True)
class StepFields:
    """Named views of the packed step storage, each at its fixed offset: `StepBuffers.dev`
    holds the device tensors the graphs read, `StepBuffers.host` numpy views of the host
    staging the full path packs into. Both are built once."""
    input_ids: View = _packed("tokens")
    positions: View = _packed("tokens")
    slot_mapping: View = _packed("tokens")
    logits_indices: View = _packed("seqs")  # prefill: the row of each sequence's last real token
    seeds: View = _packed("rows")
    top_k: View = _packed("rows")
    block_tables: View = _packed("table")  # [max_seqs, max_blocks_per_seq]
    processors: View = _packed("rows")  # 1: the row's logits go through the processors (kernels/sampler_reference.py)
    slots: View = _packed("rows")  # the row's state slot (processors, prompt scan); scratch slot otherwise
    count_slots: View = _packed("rows")  # where the drawn token is counted: the slot, or scratch when discarded
    prompt_lens: View = _packed("rows")  # tokens of the original prompt (for the prompt scan of prefill chunks)
    eos_until: View = _packed("rows")  # stop ids are masked while the drawn token's position is below this
    logprobs: View = _packed("rows")  # 1: compute the row's log-probabilities
    # A decode key's graph begins with the advance (kernels/advance.py): [0] its mode (FRESH, which
    # every upload writes; the graph leaves ADVANCE behind it), [1] the real rows of the step.
    control: View = _packed("control")
    gather_src: View = _packed("seqs")  # FRESH decode step: row r's input token is next_tokens[gather_src[r]] (-1: kept)
    temperature: View = _packed("rows", "floats")
    top_p: View = _packed("rows", "floats")
    min_p: View = _packed("rows", "floats")
    repetition_penalty: View = _packed("rows", "floats")
    presence_penalty: View = _packed("rows", "floats")
    frequency_penalty: View = _packed("rows", "floats")


# The advance's modes (control[0], defined with the op in kernels/advance.py): FRESH: inputs just
# uploaded (gathered rows take their token from next_tokens); ADVANCE: the same rows as the last
# replay, one position on (positions, input tokens from next_tokens, slots, the staged new blocks);
# AS_IS: replay on the inputs as they are (a repeated execute without new inputs: timing loops,
# replay-vs-eager checks).
CONTROL_SIZE = 2

# (name, group, size) of every packed field, in storage order (tests import this list)
FIELDS = tuple((f.name, f.metadata["group"], f.metadata["size"]) for f in fields(StepFields))
# The neutral value of each per-row sampling field: padding rows and rows that do not use it.
ROW_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "seeds": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "presence_penalty": 0.0, "frequency_penalty": 0.0, "processors": 0, "prompt_lens": 0,
                "eos_until": 0, "logprobs": 0}


@dataclass
class StepBuffers:
    max_tokens: int
    max_seqs: int
    max_rows: int
    max_blocks_per_seq: int
    device: torch.device
    vocab_size: int = 0
    num_slots: int = 0  # state slots of running sequences (the scratch slot is added)
    ints: torch.Tensor = field(init=False)  # every int64 field, packed
    floats: torch.Tensor = field(init=False)  # every fp32 field, packed
    raw: torch.Tensor = field(init=False)  # uint8: ints then floats (views of it), what one upload copies
    ints_host: torch.Tensor = field(init=False)  # their host staging (pinned on CUDA), views of raw_host
    floats_host: torch.Tensor = field(init=False)
    raw_host: torch.Tensor = field(init=False)
    dev: StepFields = field(init=False)  # named device views of `ints` / `floats`
    host: StepFields = field(init=False)  # named numpy views of the staging: write after staging_ready()
    next_tokens: torch.Tensor = field(init=False)  # [max_rows] int64: the step's drawn tokens, written in the graph
    # [1 + 3 * max_seqs] int64: the fast path's new block entries for the next ADVANCE, a count then
    # (row, column, block) each; staged by the host, consumed (count set to 0) by the advance
    new_blocks: torch.Tensor = field(init=False)
    # [max_seqs] int64: drafts accepted per row, written by verify keys only (other keys leave it stale)
    accepted: torch.Tensor = field(init=False)

    def __post_init__(self):
        shapes = {"tokens": (self.max_tokens,), "rows": (self.max_rows,), "seqs": (self.max_seqs,),
                  "table": (self.max_seqs, self.max_blocks_per_seq), "control": (CONTROL_SIZE,)}
        pin = self.device.type == "cuda"
        spans, ends = {}, {"ints": 0, "floats": 0}  # name -> (group, offset, shape); group -> elements
        for name, group, size in FIELDS:
            spans[name] = (group, ends[group], shapes[size])
            ends[group] += math.prod(shapes[size])
        self._int_bytes = ends["ints"] * 8
        self._nbytes = self._int_bytes + ends["floats"] * 4
        self.raw = torch.zeros(self._nbytes, dtype=torch.uint8, device=self.device)
        self.ints, self.floats = self._groups(self.raw)
        self.raw_host = torch.zeros(self._nbytes, dtype=torch.uint8, pin_memory=pin)
        self.ints_host, self.floats_host = self._groups(self.raw_host)

        self._spans = spans
        self.dev = StepFields(**self._views(self.ints, self.floats))
        self.host = self._host_fields(self.ints_host, self.floats_host)
        self.next_tokens = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)
        self.accepted = torch.zeros(self.max_seqs, dtype=torch.int64, device=self.device)
        self.new_blocks = torch.zeros(1 + 3 * self.max_seqs, dtype=torch.int64, device=self.device)
        self._uploaded = torch.cuda.Event() if pin else None
        self._ring: list[tuple] = []  # (raw_host, ints_host, floats_host, host, uploaded) per slot; empty: one slot
        self._turn = 0
        self.scratch_slot = self.num_slots
        S, dev = self.num_slots + 1, self.device
        self.state = {
            "token_counts": torch.zeros(S, self.vocab_size, dtype=torch.int32, device=dev),
            "bias_ids": torch.full((S, LOGIT_BIAS_CAPACITY), -1, dtype=torch.int64, device=dev),
            "bias_values": torch.zeros(S, LOGIT_BIAS_CAPACITY, dtype=torch.float32, device=dev),
            "stop_ids": torch.zeros(S, MAX_STOP_IDS, dtype=torch.int64, device=dev),
            "logprob_values": torch.zeros(self.max_rows, 1 + MAX_LOGPROBS, dtype=torch.float32, device=dev),
            "logprob_ids": torch.zeros(self.max_rows, MAX_LOGPROBS, dtype=torch.int64, device=dev),
        }

    def _groups(self, raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The int64 and fp32 views of a packed byte tensor (ints first: 8-byte aligned)."""
        return raw[:self._int_bytes].view(torch.int64), raw[self._int_bytes:].view(torch.float32)

    def _views(self, ints: torch.Tensor, floats: torch.Tensor) -> dict:
        groups = {"ints": ints, "floats": floats}
        return {n: groups[g][o:o + math.prod(shape)].view(shape) for n, (g, o, shape) in self._spans.items()}

    def _host_fields(self, ints: torch.Tensor, floats: torch.Tensor) -> StepFields:
        return StepFields(**{n: t.numpy() for n, t in self._views(ints, floats).items()})

    def write_slot(self, slot: int, logit_bias: tuple, stop_ids: list[int]) -> None:
        """A sequence's logit_bias and min_tokens stop ids, when it enters `slot` (small copies,
        ordered before the step that reads them)."""
        ids = torch.full((LOGIT_BIAS_CAPACITY,), -1, dtype=torch.int64)
        vals = torch.zeros(LOGIT_BIAS_CAPACITY, dtype=torch.float32)
        if logit_bias:
            ids[:len(logit_bias)] = torch.tensor([t for t, _ in logit_bias])
            vals[:len(logit_bias)] = torch.tensor([b for _, b in logit_bias])
        stops = torch.tensor((list(stop_ids) or [0]) * MAX_STOP_IDS, dtype=torch.int64)[:MAX_STOP_IDS]
        self.state["bias_ids"][slot].copy_(ids)
        self.state["bias_values"][slot].copy_(vals)
        self.state["stop_ids"][slot].copy_(stops)

    # ---- the full path's upload ----------------------------------------------------
    def stage_slots(self, n: int) -> None:
        """A ring of `n` host staging slots (the current one first, the others pinned alike):
        `staging_ready` moves to the next slot, waits only for the upload that slot made
        `n` uploads ago, and copies the last slot's values into it (what a writer finds there is
        what one slot would hold: the last step's values, written over in part)."""
        pin = self.device.type == "cuda"
        self._ring = [(self.raw_host, self.ints_host, self.floats_host, self.host, self._uploaded)]
        stride = -(-self._nbytes // 64) * 64  # each slot 64-byte aligned, all in one pinned allocation
        block = torch.empty((max(n - 1, 0), stride), dtype=torch.uint8, pin_memory=pin)
        for row in block.unbind(0):
            raw = row[:self._nbytes]  # its values: the last slot's, copied in when it is used
            groups = self._groups(raw)
            self._ring.append((raw, *groups, self._host_fields(*groups), torch.cuda.Event() if pin else None))
        self._turn = 0

    def staging_ready(self) -> None:
        """Wait until the host staging may be rewritten: the last upload has left it (one
        slot), or the next slot of the ring is free, with the last slot's values copied in."""
        if len(self._ring) > 1:
            last = self.raw_host
            self._turn = (self._turn + 1) % len(self._ring)
            self.raw_host, self.ints_host, self.floats_host, self.host, self._uploaded = self._ring[self._turn]
            if self._uploaded is not None:
                self._uploaded.synchronize()
            self.raw_host.numpy()[:] = last.numpy()
        elif self._uploaded is not None:
            self._uploaded.synchronize()

    def upload(self) -> None:
        """The host->device copy of a full-path step's ints and floats (one, non-blocking from
        pinned memory)."""
        self.raw.copy_(self.raw_host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every persistent tensor, by name, for the address snapshot."""
        return {"ints": self.ints, "floats": self.floats, "next_tokens": self.next_tokens,
                "accepted": self.accepted, "new_blocks": self.new_blocks, **self.state}

    def layout(self) -> list[dict]:
        """For the manifest: name, shape, dtype of every field."""
        named = [(n, getattr(self.dev, n)) for n, _, _ in FIELDS]
        named += [("next_tokens", self.next_tokens), ("accepted", self.accepted), ("new_blocks", self.new_blocks),
                  *self.state.items()]
        return [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for n, t in named]
