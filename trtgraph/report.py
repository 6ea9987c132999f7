"""Human-readable text for the CLI: manifest summaries and key tables."""

from __future__ import annotations

from .artifacts import Manifest

MiB = 1 << 20


def table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    """A plain aligned text table (columns in `right` are right-aligned)."""
    right = right or set()
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def key_label(key) -> str:
    """A graph key as every message spells it: `(bs=4, decode draft=0, greedy)`."""
    return str(key)


def manifest_text(manifest: Manifest, path) -> str:
    m, env, t, lim = manifest.model, manifest.environment, manifest.totals, manifest.config["limits"]
    src = f"synthetic seed {m.get('seed')}" if m.get("source") == "synthetic" else \
        f"{len(m.get('weight_files', []))} weight file(s)"
    kv = manifest.kv_cache
    lines = [
        f"manifest  {path}  (format {manifest.format_version}, trtgraph {manifest.trtgraph_version}, "
        f"created {manifest.created})",
        f"model     {m.get('architecture')}, {m.get('parameter_count', 0):,} parameters, {m.get('dtype')}, "
        f"{src}, config {m.get('config_hash')}",
        f"env       torch {env.get('torch')}, cuda {env.get('cuda')}, triton {env.get('triton')}, "
        f"device {env.get('device_name')} (capability {env.get('capability')}), backend {env.get('backend')}",
        *_checkpoint_lines(manifest),
        f"limits    max_batch_size {lim['max_batch_size']}, max_seq_len {lim['max_seq_len']}, "
        f"max_num_tokens {lim['max_num_tokens']}",
        f"kv cache  {kv.get('num_blocks')} blocks x {kv.get('block_size')} tokens, "
        f"{kv.get('bytes', 0) / MiB:.1f} MiB",
        f"totals    {t.get('num_keys')} keys, warm-up {t.get('warmup_seconds', 0):.2f} s, capture "
        f"{t.get('capture_seconds', 0):.2f} s, pool {t.get('pool_bytes', 0) / MiB:.1f} MiB",
        *_gemm_lines(t),
        "",
        keys_table(manifest),
    ]
    return "\n".join(lines)


def check_text(diffs: list) -> str:
    """`inspect --check`'s verdict: a match, or the differences and what to do about them (a
    checkpoint that only moved is served with `run --model`; anything else is recaptured)."""
    if not diffs:
        return "check: this machine matches the manifest"
    fix = ("the checkpoint is not at its path: serve it from where it is now with `trtgraph run --model DIR`"
           if all(d.field.startswith("config.model.path") for d in diffs) else
           "recapture here with `trtgraph capture --config ...`")
    return f"check: DIFFERS from the manifest; {fix}\n" + "\n".join(f"  {d}" for d in diffs)


def _gemm_lines(totals: dict) -> list[str]:
    """Each GEMM shape's backend, with capture's times where it timed them: as chosen, and cuBLAS alone."""
    backends, times = totals.get("linear_backends") or {}, totals.get("linear_times_us") or {}
    if not backends:
        return []
    shapes = []
    for shape, b in backends.items():
        t = times.get(shape)
        if not t:
            shapes.append(f"{shape} {b}")
        elif t["chosen"] == t["cublas"]:
            shapes.append(f"{shape} {b} ({t['cublas']:.1f} us)")
        else:
            shapes.append(f"{shape} {b} ({t['chosen']:.1f} us; cublas alone {t['cublas']:.1f} us)")
    return ["gemms     " + "; ".join(shapes) + (" (one call at each of the plan's row counts, summed)" if times else "")]


def _checkpoint_lines(manifest: Manifest) -> list[str]:
    """Where the checkpoint was (it may have moved: `run --model PATH`) and its generation defaults."""
    m, src = manifest.model, manifest.config.get("model", {})
    if m.get("source") != "checkpoint":
        return []
    hub = m.get("hub")
    where = (f"hub {hub['repo']} (revision {hub['revision']}, snapshot {hub['snapshot']})" if isinstance(hub, dict)
             else f"path {src.get('path')}")
    gen = m.get("generation_config") or {}
    if gen.get("do_sample"):
        sampling = ", ".join(f"{k} {gen[k]}" for k in ("temperature", "top_p", "top_k") if gen.get(k) is not None)
        defaults = f"sampled ({sampling or 'temperature 1.0'})"
    else:
        defaults = "greedy"
    eos = gen.get("eos_token_ids") or []
    return [f"checkpoint {where}; {len(m.get('files', []))} config/tokenizer file(s) hashed",
            f"generation defaults {defaults}; end-of-sequence ids from generation_config.json: "
            f"{', '.join(map(str, eos)) or 'none'}"]


def keys_table(manifest: Manifest) -> str:
    rows = []
    for r in manifest.keys:
        parity = "ok" if r.tokens_equal else "TOKENS DIFFER"
        rows.append([key_label(r.key), str(r.num_tokens), f"{r.capture_seconds * 1e3:.1f}",
                     f"{r.pool_bytes / MiB:.2f}", f"{r.replay_ms:.3f}", f"{r.eager_ms:.3f}",
                     f"{parity} ({r.max_abs_logit_diff:.2g})"])
    return table(["key", "tokens", "capture ms", "pool MiB", "replay ms", "eager ms", "parity (max |dlogit|)"],
                 rows, right={1, 2, 3, 4, 5})


def run_summary(s: dict, eager: bool) -> str:
    """The closing summary of `run` (standard error), from RunStats.to_json()."""
    mode = "eager (no graphs)" if eager else "replay"
    lines = [f"{s['requests']} requests ({s['refused']} refused), {s['completion_tokens']} tokens generated "
             f"in {s['seconds']:.2f} s: {s['tokens_per_second']:.1f} tokens/s [{mode}]",
             f"{s['steps']} steps ({s['fast_path_steps']} on the fast path), padding waste "
             f"{s['padding_waste_pct']:.1f}%, {s['preemptions']} preemptions",
             "steps per key:"]
    lines += [f"  {k}: {v}" for k, v in s["steps_per_key"].items()]
    if "speculative" in s:
        sp = s["speculative"]
        lines.append(f"speculative: {sp['verify_steps']} verify steps and {sp['plain_decode_steps']} plain decode "
                     f"steps (the policy drafts where it pays), draft acceptance "
                     f"{100 * sp['acceptance_rate']:.1f}%, {sp['mean_tokens_per_row_step']:.2f} tokens per "
                     f"sequence per verify step")
    return "\n".join(lines)
