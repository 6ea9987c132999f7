"""Persistent step buffers: allocated once from the limits, never re-allocated.

Every graph reads its inputs from views at offset 0 of these tensors. All per-step integer
metadata lives in one int64 tensor (`ints`) and the float sampling parameters in one fp32
tensor (`floats`), each with a host staging twin (pinned on CUDA), so a step's inputs
cross to the device in two copies. `sampled` holds the last step's tokens on the device,
where the steady-state fast path gathers the next inputs from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

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
)
FLOAT_FIELDS = (("temperature", "rows"), ("top_p", "rows"))


@dataclass
class StepBuffers:
    max_tokens: int
    max_seqs: int
    max_rows: int
    max_blocks_per_seq: int
    device: torch.device
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
        return {"ints": self.ints, "floats": self.floats, "sampled": self.sampled, "accepted": self.accepted}

    def layout(self) -> list[dict]:
        """For the manifest: name, shape, dtype of every field."""
        out = []
        for name, (group, _off, size) in self.offsets.items():
            shape = [self.max_seqs, self.max_blocks_per_seq] if name == "block_tables" else [size]
            out.append({"name": name, "shape": shape, "dtype": "int64" if group == "ints" else "float32"})
        out.append({"name": "sampled", "shape": [self.max_rows], "dtype": "int64"})
        out.append({"name": "accepted", "shape": [self.max_seqs], "dtype": "int64"})
        return out
