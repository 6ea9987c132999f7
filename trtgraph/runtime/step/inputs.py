"""A step's inputs in the persistent buffers: the full path packs validated rows (padding
written explicitly) on the host and copies once; the steady-state fast path advances the
inputs on the device. `Executor` inherits these methods (`StepInputs`); they read its
buffers, block size and limits.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from operator import attrgetter

import numpy as np
import torch

from ...buckets import GraphKey
from ...errors import ReplayMismatchError
from .buffers import AS_IS, FRESH, ROW_DEFAULTS
from .kv_cache import NULL_BLOCK, blocks_for_tokens


@dataclass
class StepRow:
    """One sequence's part of a step."""
    token_ids: list[int] | np.ndarray  # the real query tokens: q of them, or fewer in a prefill chunk's tail
    start_pos: int  # position of token_ids[0] in its sequence
    block_table: list[int]  # blocks covering positions 0 .. start_pos + len(token_ids) - 1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    min_p: float = 0.0
    # logits processors (kernels/sampler_reference.py); `processors` False leaves the logits untouched
    processors: bool = False
    slot: int | None = None  # the sequence's state slot (None: the scratch slot)
    counted: bool = True  # whether the drawn token counts (False: a prefill chunk that is not the last)
    prompt_len: int = 0
    eos_until: int = 0  # stop ids masked while the drawn token's position is below this
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: bool = False


# StepRow attribute -> per-row buffer field, integer fields then float fields
ROW_FIELDS = {"top_k": "top_k", "seed": "seeds", "processors": "processors", "prompt_len": "prompt_lens",
              "eos_until": "eos_until", "logprobs": "logprobs",
              "temperature": "temperature", "top_p": "top_p", "min_p": "min_p",
              "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
              "frequency_penalty": "frequency_penalty"}
_INT_FIELDS = tuple(ROW_FIELDS.values())[:6]
_FLOAT_FIELDS = tuple(ROW_FIELDS.values())[6:]
_int_values = attrgetter(*tuple(ROW_FIELDS)[:6])  # one row's integer fields as a tuple
_float_values = attrgetter(*tuple(ROW_FIELDS)[6:])



def advances(key: GraphKey) -> bool:
    """Whether `key`'s graph begins with the advance of its inputs (kernels/advance.py): plain
    decode keys, the only ones a step can repeat on the fast path."""
    return not key.is_prefill and not key.draft_len


class StepInputs:
    """The executor's input preparation (mixed into `Executor`, which sets up `_new_blocks_host`,
    a ring of pinned staging slots for the fast path's new block entries)."""

    _real_rows = 0  # real rows of the last full-path step (the device's control[1])
    _inputs_set = False  # prepare or advance_decode since the last execute
    _last_packed: tuple = (None, ())  # (key, rows) of the last full-path verify step (`_prepare_verify_again`)
    _verify_have: np.ndarray | None = None  # the block-table length of each row, as the staging holds them

    # ---- input preparation (full path) ------------------------------------------------
    def prepare(self, key: GraphKey, rows: list[StepRow], gather: list[tuple[int, int]] = ()) -> None:
        """Pack `rows` into host staging, write every padding row explicitly, check what the
        rows put there (a graph that reads an out-of-range block id corrupts memory
        silently), copy once. Vectorised over rows: each field is one numpy write.
        gather: (row, drawn row) pairs whose input token the decode key's graph takes from the
        drawn tokens of the step before (a decode step launched after a prefill, before its
        tokens were read); their `token_ids` here are placeholders."""
        q, B, bs, T = key.q_len, key.batch_size, self.block_size, key.num_tokens
        if len(rows) > B:
            raise ReplayMismatchError(f"{len(rows)} rows do not fit {key}")
        last_key, last_rows = self._last_packed
        if rows and key is last_key and key.draft_len and not gather and len(rows) == len(last_rows) \
                and all(a is b for a, b in zip(rows, last_rows)):
            self._prepare_verify_again(key, rows)
            return
        self._last_packed = (key, rows if key.draft_len and not gather else ())
        n = len(rows)
        lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, n)  # [n] query tokens per row
        starts = np.fromiter((r.start_pos for r in rows), np.int64, n)
        have = np.fromiter((len(r.block_table) for r in rows), np.int64, n)  # [n] blocks per table
        self._check_row_shapes(key, rows, lens, starts, have)
        b = self.buffers
        b.staging_ready()
        ids, pos, slots = b.host.input_ids, b.host.positions, b.host.slot_mapping
        last, tables = b.host.logits_indices, b.host.block_tables
        # Padding first (every row of the key), then the real rows on top.
        ids[:T] = 0
        slots[:T] = np.arange(T) % bs + NULL_BLOCK * bs
        last[:B] = np.arange(B) * q
        tables[:B] = NULL_BLOCK
        self._write_tables(key, rows, np.arange(n), have)
        self._verify_have = have
        # Real tokens: row i's j-th at i * q + j. A prefill chunk's tail (j >= its length)
        # repeats the last position and writes to the null block.
        col = np.arange(q)
        pos2 = starts[:, None] + np.minimum(col[None, :], lens[:, None] - 1)  # [n, q]
        pos[:n * q] = pos2.ravel()
        pos[n * q:T] = 0
        real = col[None, :] < lens[:, None]  # [n, q]
        flat = np.flatnonzero(real)  # where real tokens go, row-major: i * q + j
        if q == 1:  # one token a row
            ids[flat] = np.fromiter((r.token_ids[0] for r in rows), np.int64, n)
        elif key.draft_len and len(flat) == n * q:  # verify rows (lists of q tokens each): one pass in C
            ids[flat] = np.fromiter(chain.from_iterable(r.token_ids for r in rows), np.int64, n * q)
        elif n:  # prefill chunks (the launcher hands numpy slices of the prompts) and verify rows
            ids[flat] = np.concatenate([np.asarray(r.token_ids, dtype=np.int64) for r in rows])
        p, row_of = pos[flat], flat // q
        slots[flat] = tables[row_of, p // bs] * bs + p % bs
        last[:n] = np.arange(n) * q + lens - 1
        self._pack_sampling(key, rows)
        self._check_values(key, "token_ids", ids[:n * q], 0, self.loaded.config.vocab_size, q)
        pairs = self._check_gather(key, n, gather)
        b.host.gather_src[:B] = -1
        b.host.gather_src[pairs[:, 0]] = pairs[:, 1]
        b.host.control[:] = (FRESH, n)
        b.upload()
        self._real_rows, self._inputs_set = n, True

    def _prepare_verify_again(self, key: GraphKey, rows: list[StepRow]) -> None:
        """A verify step over the very rows (the same StepRow objects, in order) of the full-path
        step packed last, with the same key: what depends only on the rows and the key (their
        sampling fields, the padding, the logit rows, the gather sources, the control) is in the
        staging already; only each row's q tokens, positions and slots are written and checked
        (a verify row feeds exactly q tokens, so no row has a tail), and the block-table entries
        the rows gained since (a running sequence's table only grows: the rows whose table is
        longer than when last written get theirs written and checked again, whole)."""
        q, bs, n = key.q_len, self.block_size, len(rows)
        starts = np.fromiter((r.start_pos for r in rows), np.int64, n)
        have = np.fromiter((len(r.block_table) for r in rows), np.int64, n)
        lens = np.fromiter((len(r.token_ids) for r in rows), np.int64, n)
        ends = starts + q
        if ((lens != q) | (starts < 0) | (ends > self.config.limits.max_seq_len)
                | ((ends + bs - 1) // bs > have) | (have > self.max_blocks_per_seq)).any():
            self._check_row_shapes(key, rows, lens, starts, have)
            raise ReplayMismatchError(f"{key} row {int(np.flatnonzero(lens != q)[0])}: a verify row feeds {q} tokens")
        b = self.buffers
        b.staging_ready()
        ids, pos, slots, tables = b.host.input_ids, b.host.positions, b.host.slot_mapping, b.host.block_tables
        grew = np.flatnonzero(have != self._verify_have)
        if len(grew):
            self._write_tables(key, [rows[i] for i in grew], grew, have[grew])
            self._verify_have = have
        ids[:n * q] = np.fromiter(chain.from_iterable(r.token_ids for r in rows), np.int64, n * q)
        p = (starts[:, None] + np.arange(q)).ravel()  # [n * q]
        pos[:n * q] = p
        slots[:n * q] = tables[np.repeat(np.arange(n), q), p // bs] * bs + p % bs
        self._check_values(key, "token_ids", ids[:n * q], 0, self.loaded.config.vocab_size, q)
        b.upload()
        self._real_rows, self._inputs_set = n, True

    def _write_tables(self, key: GraphKey, rows: list[StepRow], at: np.ndarray, have: np.ndarray) -> None:
        """The block tables of `rows` into the staging's table rows `at` (have: their lengths), checked."""
        tables = self.buffers.host.block_tables
        table_row = np.repeat(at, have)  # [sum(have)] the table row of each entry
        table_col = np.arange(len(table_row)) - np.repeat(np.cumsum(have) - have, have)
        tables[table_row, table_col] = np.fromiter(chain.from_iterable(r.block_table for r in rows), np.int64,
                                                   len(table_row))
        self._check_values(key, "block_table", tables[table_row, table_col], 1, self.num_blocks, None, table_row)

    def _pack_sampling(self, key: GraphKey, rows: list[StepRow]) -> None:
        """The per-row sampling fields: neutral values on every logit row of the key, then each
        real row's values (one matrix per dtype built in one pass over the rows, one vector
        write per field; a decode row covers its q logit rows)."""
        b, R = self.buffers, key.num_logit_rows
        per = 1 if key.is_prefill else key.q_len
        n = len(rows) * per
        scratch = b.scratch_slot
        for fields, getter, dtype in ((_INT_FIELDS, _int_values, np.int64), (_FLOAT_FIELDS, _float_values, np.float64)):
            values = np.array([getter(r) for r in rows], dtype=dtype).reshape(len(rows), len(fields))
            if per > 1:
                values = np.repeat(values, per, axis=0)
            for j, name in enumerate(fields):
                arr = getattr(b.host, name)
                arr[:R] = ROW_DEFAULTS[name]
                arr[:n] = values[:, j]
        slot = np.fromiter((scratch if r.slot is None else r.slot for r in rows), np.int64, len(rows))
        counted = np.fromiter((r.counted for r in rows), bool, len(rows))
        b.host.slots[:R] = scratch
        b.host.slots[:n] = np.repeat(slot, per)
        b.host.count_slots[:R] = scratch
        b.host.count_slots[:n] = np.repeat(np.where(counted, slot, scratch), per)

    def _check_row_shapes(self, key: GraphKey, rows: list[StepRow], lens: np.ndarray, starts: np.ndarray,
                          have: np.ndarray) -> None:
        """What must hold before rows can be packed at all, checked at once; the first row
        that fails is named by `_check_row_shape`."""
        q, max_len = key.q_len, self.config.limits.max_seq_len
        ends = starts + lens
        need = (ends + self.block_size - 1) // self.block_size
        bad = ((lens < 1) | (lens > q) | (starts < 0) | (ends > max_len) | (need > have)
               | (have > self.max_blocks_per_seq))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            self._check_row_shape(key, i, rows[i], int(lens[i]))

    def _check_row_shape(self, key: GraphKey, i: int, row: StepRow, n: int) -> None:
        """What must hold before a row can be packed at all (scalar checks, one row)."""
        q, max_len = key.q_len, self.config.limits.max_seq_len
        if not 1 <= n <= q:
            raise ReplayMismatchError(f"{key} row {i}: {n} query tokens; the key takes 1..{q}")
        if not 0 <= row.start_pos <= max_len - n:
            raise ReplayMismatchError(f"{key} row {i}: start_pos = {row.start_pos} with {n} tokens; positions "
                                      f"must lie in [0, limits.max_seq_len = {max_len})")
        need, have = blocks_for_tokens(row.start_pos + n, self.block_size), len(row.block_table)
        if not need <= have <= self.max_blocks_per_seq:
            raise ReplayMismatchError(f"{key} row {i}: block_table has {have} blocks; positions up to "
                                      f"{row.start_pos + n - 1} need {need}, and a sequence holds at most "
                                      f"{self.max_blocks_per_seq}")

    @staticmethod
    def _check_values(key: GraphKey, name: str, values: np.ndarray, lo: int, hi: int, per_row: int | None,
                      row_of: np.ndarray | None = None) -> None:
        """All `values` in [lo, hi), checked at once; the first one outside names its row."""
        if values.size == 0 or (values.min() >= lo and values.max() < hi):
            return
        bad = int(np.flatnonzero((values < lo) | (values >= hi))[0])
        row = bad // per_row if per_row else int(row_of[bad])
        raise ReplayMismatchError(f"{key} row {row}: {name} holds {int(values[bad])}, outside [{lo}, {hi}); "
                                  f"refusing to replay a graph on it (it would read or write memory it "
                                  f"does not own)")

    # ---- input preparation (steady-state fast path) -------------------------------------
    def advance_decode(self, num_real: int, new_blocks: list[tuple[int, int, int]]) -> None:
        """The same generation rows as the step executed last, in the same order: the key's
        graph advances them itself (positions += 1, input tokens from the last step's drawn
        tokens, slots one on; kernels/advance.py). Here only the rows that entered a new block
        ((row, column, block) each), checked on the host, are staged for it: one small copy,
        none when no row entered one. Padding rows keep what the last full path wrote."""
        entries = np.asarray(new_blocks, dtype=np.int64).reshape(-1, 3)  # [n, 3]: row, column, block
        if num_real != self._real_rows:
            raise ReplayMismatchError(f"fast-path decode step over {num_real} rows after a full-path step of "
                                      f"{self._real_rows}: the fast path repeats the last step's rows")
        if len(entries):
            self._check_new_blocks(num_real, entries)
            self._stage_new_blocks(entries)
        self._inputs_set = True

    def _stage_new_blocks(self, entries: np.ndarray) -> None:
        """The count and the entries into `new_blocks` without a host sync: written to the next
        of a ring of pinned staging slots and copied without blocking. A slot is rewritten only
        two launches later, after the engine has waited for the step that copied from it."""
        n = len(entries)
        self._new_blocks_turn = (self._new_blocks_turn + 1) % len(self._new_blocks_host)
        staged = self._new_blocks_host[self._new_blocks_turn][:1 + 3 * n]
        staged.numpy()[0] = n
        staged.numpy()[1:] = entries.ravel()
        self.buffers.new_blocks[:1 + 3 * n].copy_(staged, non_blocking=True)

    def before_execute(self, key: GraphKey) -> None:
        """A decode key executed again without new inputs (`prepare` or `advance_decode`) runs on
        the inputs as they are, not one position on (timing loops, replay-vs-eager checks). The
        host knows when: then one small device write sets the mode to AS_IS."""
        if not self._inputs_set and self._real_rows and advances(key):
            self.buffers.dev.control[0:1].fill_(AS_IS)
        self._inputs_set = False

    def inputs_used(self) -> None:
        """A step ran on the inputs set last (warm-up and capture run the closure themselves)."""
        self._inputs_set = False

    def _check_gather(self, key: GraphKey, n: int, pairs: list[tuple[int, int]]) -> np.ndarray:
        """A decode step launched before the prefill step ahead of it was read: (row here, row of
        that prefill's drawn tokens) pairs, checked; the graph gathers the tokens (FRESH)."""
        idx = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        R = self.buffers.next_tokens.shape[0]
        if len(idx) and (not advances(key) or idx.min() < 0 or idx[:, 0].max() >= n or idx[:, 1].max() >= R):
            raise ReplayMismatchError(f"{key}: gather pairs {pairs} outside the step's {n} rows or the drawn "
                                      f"tokens' {R} (a decode key takes them)")
        return idx

    def _check_new_blocks(self, num_real: int, entries: np.ndarray) -> None:
        """The fast path's new (row, column, block) entries, checked at once on the host."""
        lo = np.array([0, 0, 1])
        hi = np.array([num_real, self.max_blocks_per_seq, self.num_blocks])
        bad = (entries < lo) | (entries >= hi)  # [n, 3]
        if not bad.any():
            return
        i, col = (int(v) for v in np.argwhere(bad)[0])
        r, c, blk = (int(v) for v in entries[i])
        what = ("row", "column", "block id")[col]
        raise ReplayMismatchError(f"fast-path decode step: new block entry (row {r}, column {c}, block {blk}) "
                                  f"has its {what} outside [{int(lo[col])}, {int(hi[col])}); refusing to write "
                                  f"it into the block tables")
