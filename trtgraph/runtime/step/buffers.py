"""Persistent step buffers: allocated once from the limits, never re-allocated.

Every graph reads its inputs from views at offset 0 of these tensors. All per-step integer
metadata lives in one int64 tensor (`ints`) and the float sampling parameters in one fp32
tensor (`floats`), each with a host staging twin (pinned on CUDA), so a step's inputs
cross to the device in two copies. `sampled` holds the last step's tokens on the device,
where the steady-state fast path gathers the next inputs from.

Per-sequence sampling state lives by slot (`Sequence.slot`; the last slot is scratch for
rows that use no processor, and for padding): `token_counts` [slots + 1, V] int32 (generated
count, bit 24 = "in the prompt"), written inside the graphs; `bias_ids` / `bias_values` and
`stop_ids`, written once when a sequence that uses them enters its slot (`write_slot`).
`logprob_values` [rows, 1 + MAX_LOGPROBS] / `logprob_ids` [rows, MAX_LOGPROBS] hold each
row's log-probabilities, read back only when a row asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..serving.requests import LOGIT_BIAS_CAPACITY, MAX_LOGPROBS, MAX_STOP_TOKEN_IDS

# stop ids masked for min_tokens: the model's EOS ids and the request's stop ids
MAX_STOP_IDS = MAX_STOP_TOKEN_IDS + 8

# name -> which limit sizes it: "tokens" (max_num_tokens), "rows" (max logit rows),
# "seqs" (max batch size), "table" (max batch size * blocks per sequence)
INT_FIELDS = (
    ("input_ids", "tokens"),
    ("positions", "tokens"),
    ("slot_mapping", "tokens"),
    ("logits_indices", "seqs"),  # prefill: the row of each sequence's last real token
    ("seeds", "rows"),
    ("top_k", "rows"),
    ("block_tables", "table"),
    ("processors", "rows"),  # 1: the row's logits go through the processors (runtime/step/sampler.py)
    ("slots", "rows"),  # the row's state slot (processors, prompt scan); scratch slot otherwise
    ("count_slots", "rows"),  # where the drawn token is counted: the slot, or scratch when discarded
    ("prompt_lens", "rows"),  # tokens of the original prompt (for the prompt scan of prefill chunks)
    ("eos_until", "rows"),  # stop ids are masked while the drawn token's position is below this
    ("logprobs", "rows"),  # 1: compute the row's log-probabilities
)
FLOAT_FIELDS = (("temperature", "rows"), ("top_p", "rows"), ("min_p", "rows"), ("repetition_penalty", "rows"),
                ("presence_penalty", "rows"), ("frequency_penalty", "rows"))
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
    ints: torch.Tensor = field(init=False)
    floats: torch.Tensor = field(init=False)
    ints_host: torch.Tensor = field(init=False)
    floats_host: torch.Tensor = field(init=False)
    sampled: torch.Tensor = field(init=False)  # [max_rows] int64, written inside the graph
    accepted: torch.Tensor = field(init=False)  # [max_seqs] int64: drafts accepted per row (verify keys)
    offsets: dict = field(init=False)

    def __post_init__(self):
        sizes = {"tokens": self.max_tokens, "rows": self.max_rows, "seqs": self.max_seqs,
                 "table": self.max_seqs * self.max_blocks_per_seq}
        self.offsets = {}
        pin = self.device.type == "cuda"
        for group, fields_, dtype in (("ints", INT_FIELDS, torch.int64), ("floats", FLOAT_FIELDS, torch.float32)):
            offset = 0
            for name, size_kind in fields_:
                self.offsets[name] = (group, offset, sizes[size_kind])
                offset += sizes[size_kind]
            setattr(self, group, torch.zeros(offset, dtype=dtype, device=self.device))
            setattr(self, group + "_host", torch.zeros(offset, dtype=dtype, pin_memory=pin))
        self.sampled = torch.zeros(self.max_rows, dtype=torch.int64, device=self.device)
        self.accepted = torch.zeros(self.max_seqs, dtype=torch.int64, device=self.device)  # verify steps
        self._uploaded = torch.cuda.Event() if pin else None
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

    # ---- views (device, offset 0 of each field) ------------------------------------
    def view(self, name: str, host: bool = False) -> torch.Tensor:
        group, offset, size = self.offsets[name]
        t = getattr(self, group + ("_host" if host else ""))[offset:offset + size]
        if name == "block_tables":
            t = t.view(self.max_seqs, self.max_blocks_per_seq)
        return t

    def host_np(self, name: str):
        """A numpy view of the host staging for fast packing. Call `staging_ready()` first."""
        return self.view(name, host=True).numpy()

    def staging_ready(self) -> None:
        """Wait until the last upload has left the host staging, so it can be rewritten."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def upload(self) -> None:
        """The two host->device copies of a full-path step (non-blocking from pinned memory)."""
        self.ints.copy_(self.ints_host, non_blocking=True)
        self.floats.copy_(self.floats_host, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every persistent tensor, by name, for the address snapshot."""
        return {"ints": self.ints, "floats": self.floats, "sampled": self.sampled, "accepted": self.accepted,
                **self.state}

    def layout(self) -> list[dict]:
        """For the manifest: name, shape, dtype of every field."""
        out = []
        for name, (group, _off, size) in self.offsets.items():
            shape = [self.max_seqs, self.max_blocks_per_seq] if name == "block_tables" else [size]
            out.append({"name": name, "shape": shape, "dtype": "int64" if group == "ints" else "float32"})
        out.append({"name": "sampled", "shape": [self.max_rows], "dtype": "int64"})
        out.append({"name": "accepted", "shape": [self.max_seqs], "dtype": "int64"})
        out += [{"name": n, "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
                for n, t in self.state.items()]
        return out
