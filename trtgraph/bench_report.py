"""The report of `trtgraph bench`: bench.md (tables and one line per measurement) and
bench.png (decode step time against the floor), from the result dict `bench.run_bench` builds."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

Log = Callable[[str], None]


def markdown(r: dict) -> str:
    lines = [f"# trtgraph bench — {r['device']}", "",
             f"model {r['model'].get('architecture')} ({r['model'].get('parameter_count'):,} parameters, "
             f"{r['model'].get('dtype')}), kernels {r['kernels']}, {r['context_len']} cached tokens per sequence, "
             f"measured HBM bandwidth {r['hbm_bytes_per_second'] / 1e12:.2f} TB/s", "",
             "| batch | replay ms | eager ms | floor ms | replay / floor | eager / replay |",
             "|---:|---:|---:|---:|---:|---:|"]
    for d in r["decode"]:
        lines.append(f"| {d['batch_size']} | {d['replay_ms']:.3f} | {d['eager_ms']:.3f} | {d['floor_ms']:.3f} | "
                     f"{d['replay_over_floor']:.2f}x | {d['eager_over_replay']:.1f}x |")
    if "attention" in r:
        a = r["attention"]
        lines += ["", f"paged decode attention alone, batch {a['batch_size']} x {a['context_len']} cached tokens: "
                      f"{a['ms']:.3f} ms, {a['bytes_per_second'] / 1e12:.2f} TB/s "
                      f"({100 * a['fraction_of_hbm']:.1f}% of measured HBM bandwidth)"]
    if "run" in r:
        run = r["run"]
        lines += ["", f"run: {run['requests']} prompts, {run['completion_tokens']} tokens in {run['seconds']:.2f} s = "
                      f"{run['tokens_per_second']:.1f} tokens/s; padding waste {run['padding_waste_pct']}%; "
                      f"GPU idle between steps {run.get('gpu_idle_per_step_us', 'n/a')} us per step"]
        if r.get("run_bound"):
            b = r["run_bound"]
            lines += [f"step-time bound: batch {b['batch_size']} / {b['replay_ms']:.3f} ms replay = "
                      f"{b['bound_tokens_per_second']:,.0f} tokens/s; the run reached {100 * b['fraction']:.1f}% of it"]
            if b.get("own_steps"):
                o = b["own_steps"]
                lines += [f"step-time bound of the run's own steps (GPU busy {o['gpu_busy_seconds']:.3f} s in its "
                          f"{o['steps']} steps, events around each): {o['bound_tokens_per_second']:,.0f} tokens/s; "
                          f"the run reached {100 * o['fraction']:.1f}% of it"]
    lines += _mixed_and_startup_lines(r)
    if "run_without_speculation" in r:
        sp, plain = r["run"].get("speculative", {}), r["run_without_speculation"]
        lines += [f"speculation: {r['run']['tokens_per_second']:.1f} tokens/s with, "
                  f"{plain['tokens_per_second']:.1f} without; draft acceptance "
                  f"{100 * sp.get('acceptance_rate', 0):.1f}%, {sp.get('mean_tokens_per_row_step', 0):.2f} tokens per "
                  f"sequence per verify step"]
    if "hf" in r:
        h = r["hf"]
        lines += [f"transformers {h['version']} eager generate (batch {h['batch_size']}): "
                  f"{h['tokens_per_second']:.1f} tokens/s, batch-1 step {h['bs1_step_ms']:.2f} ms; "
                  f"trtgraph run is {h['trtgraph_speedup']:.1f}x"]
    if "run_tokens_identical_to_eager" in r:
        e = r["run_tokens_identical_to_eager"]
        lines += [f"replay vs eager, the same {e['requests']} requests: {e['identical']}/{e['requests']} identical"]
    if "alone_vs_crowd" in r:
        c = r["alone_vs_crowd"]
        lines += [f"alone vs in a crowd of {c['crowd']} (greedy and seeded sampled): "
                  f"{c['identical']}/{c['requests']} requests identical"]
    for p in r.get("prefill", []):
        lines += [f"prefill {p['prompts']} x {p['prompt_len']} tokens: {p['tokens_per_second']:,.0f} tokens/s, "
                  f"{p['over_roofline']:.2f}x the compute roofline ({r['peak_flops'] / 1e12:.0f} TFLOP/s measured)"]
    lines += ["", "| key | tokens | capture ms | pool MiB | replay ms |", "|---|---:|---:|---:|---:|"]
    for k in r["keys"]:
        lines.append(f"| {k['key']} | {k['num_tokens']} | {k['capture_seconds'] * 1e3:.1f} | {k['pool_mib']:.2f} | "
                     f"{k['replay_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def _mixed_and_startup_lines(r: dict) -> list[str]:
    lines = []
    if "mixed" in r:
        m = r["mixed"]
        lines += [f"mixed workload: {m['requests']} requests (prompts 8-1500 tokens, outputs 16-256, a third sampled), "
                  f"{m['completion_tokens']} tokens in {m['seconds']:.2f} s = {m['tokens_per_second']:.1f} tokens/s; "
                  f"padding {m['padding_waste_pct']}% of step tokens; {m['steps']} steps; GPU idle "
                  f"{m.get('gpu_idle_per_step_us', 'n/a')} us per step"]
    if "startup" in r:  # the bench's own engine: `imports` runs from `import trtgraph` (or from the end
        ph = dict(r["startup"]["phases_seconds"])  # of a --config capture, which laps the same clock)
        before = ph.pop("imports", 0.0) + ph.pop("interpreter", 0.0)
        lines += [f"engine start-up after imports ({sum(ph.values()):.2f} s): "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in ph.items())
                  + f"; before it (interpreter and imports; with --config, since the capture) {before:.2f} s; "
                  f"`trtgraph run --verbose` gives a whole start"]
    return lines


def plot(r: dict, path: Path, log: Log) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        log("matplotlib is not installed: no bench.png (pip install matplotlib)")
        return
    xs = [d["batch_size"] for d in r["decode"]]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, key in (("replay", "replay_ms"), ("eager", "eager_ms"), ("floor", "floor_ms")):
        ax.plot(xs, [d[key] for d in r["decode"]], marker="o", label=name)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode step (ms)")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_title(f"{r['model'].get('architecture')} {r['model'].get('dtype')} on {r['device']}, "
                 f"{r['context_len']} cached tokens")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
