"""`trtgraph serve` under load: the offline `trtgraph run` throughput, then the same prompts
sent to a live server as streaming completions with Poisson arrivals at several request
rates (and all at once): throughput, TTFT and TPOT p50 / p99 per rate, every response
compared token for token with the offline run (equal where the config is batch-invariant:
`deterministic: true`, or the CPU; otherwise a request's tokens may depend on its batch).

    python scripts/serve_bench.py --manifest ART --prompts p.jsonl --rates 4,16,64 --out OUT_DIR

Writes OUT_DIR/serve_bench.json and OUT_DIR/metrics.txt (the server's /metrics at the end)
and prints a table. Prompts: a JSONL as `trtgraph run` reads (scripts/make_prompts.py writes
one). The client is plain httpx reading the SSE lines (the `openai` client's per-chunk
parsing would make the client, not the server, the bottleneck at high rates); the server's
OpenAI compatibility is tested with the `openai` client in tests/test_server.py.
"""

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def offline(manifest: str, prompts: Path, out_dir: Path) -> tuple[dict, dict]:
    out, summary = out_dir / "offline.jsonl", out_dir / "offline_summary.json"
    subprocess.run([sys.executable, "-m", "trtgraph", "run", "--prompts", str(prompts), "--manifest", manifest,
                    "--output", str(out), "--summary-json", str(summary)], check=True)
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    return results, json.loads(summary.read_text())


def body_of(req: dict, model: str) -> dict:
    """The /v1/completions body of a native request (greedy unless it says otherwise: OpenAI's
    default temperature is 1)."""
    body = {k: v for k, v in req.items() if k not in ("id", "prompt", "prompt_token_ids")}
    body.setdefault("temperature", 0.0)
    return {**body, "model": model, "prompt": req.get("prompt", req.get("prompt_token_ids")), "stream": True}


async def one(client: httpx.AsyncClient, url: str, model: str, req: dict, start_at: float, t_zero: float) -> dict:
    await asyncio.sleep(max(0.0, t_zero + start_at - time.perf_counter()))
    t0 = time.perf_counter()
    times, toks = [], []
    async with client.stream("POST", url + "/v1/completions", json=body_of(req, model)) as r:
        if r.status_code != 200:
            raise SystemExit(f"{req['id']}: HTTP {r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"{req['id']}: {chunk['error']}")
            times.append(time.perf_counter())
            toks += chunk["choices"][0]["token_ids"]
    return {"id": req["id"], "token_ids": toks, "ttft_s": times[0] - t0,
            "tpot_s": (times[-1] - times[0]) / max(len(toks) - 1, 1), "end": times[-1]}


async def at_rate(url: str, model: str, reqs: list[dict], rate: float | None) -> dict:
    rng = random.Random(0)
    arrivals, t = [], 0.0
    for _ in reqs:
        arrivals.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=4096, max_keepalive_connections=4096),
                                 timeout=3600) as client:
        t_zero = time.perf_counter()
        done = await asyncio.gather(*(one(client, url, model, r, a, t_zero) for r, a in zip(reqs, arrivals)))
    wall = max(d["end"] for d in done) - t_zero
    tokens = sum(len(d["token_ids"]) for d in done)
    return {"rate_rps": rate, "requests": len(done), "seconds": wall, "tokens_per_second": tokens / wall,
            "ttft_ms_p50": 1e3 * percentile([d["ttft_s"] for d in done], .5),
            "ttft_ms_p99": 1e3 * percentile([d["ttft_s"] for d in done], .99),
            "tpot_ms_p50": 1e3 * percentile([d["tpot_s"] for d in done], .5),
            "tpot_ms_p99": 1e3 * percentile([d["tpot_s"] for d in done], .99),
            "outputs": {d["id"]: d["token_ids"] for d in done}}


STEP_SERIES = ("trtgraph_step_seconds_sum", "trtgraph_step_seconds_count", "trtgraph_gpu_idle_seconds_per_step_sum",
               "trtgraph_gpu_idle_seconds_per_step_count")


def step_totals(url: str) -> dict:
    """The server's step-time and GPU-idle histogram totals so far (/metrics)."""
    out = dict.fromkeys(STEP_SERIES, 0.0)
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in out:
            out[name] = float(value)
    return out


def start_server(manifest: str, port: int, max_waiting: int, log: Path) -> subprocess.Popen:
    """`trtgraph serve` on 127.0.0.1:port, healthy; its output goes to `log`."""
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "trtgraph", "serve", "--manifest", manifest, "--port",
                                 str(port), "--max-waiting", str(max_waiting)], stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 1800
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}: see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not become healthy")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--manifest", required=True)
    p.add_argument("--prompts", required=True, type=Path)
    p.add_argument("--rates", default="4,16,64", help="requests per second, comma-separated; 0 = all at once")
    p.add_argument("--out", type=Path, default=Path("serve-bench"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    reqs = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()]
    want, summary = offline(a.manifest, a.prompts, a.out)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_server(a.manifest, port, max_waiting=len(reqs) + 1, log=a.out / "server.log")
    url = f"http://127.0.0.1:{port}"
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rows = []
    try:
        for rate in [float(r) for r in a.rates.split(",")]:
            before = step_totals(url)
            row = asyncio.run(at_rate(url, model, reqs, rate or None))
            after = {k: v - before[k] for k, v in step_totals(url).items()}
            steps = after["trtgraph_step_seconds_count"]
            row["steps"] = int(steps)
            row["step_ms_mean"] = 1e3 * after["trtgraph_step_seconds_sum"] / max(steps, 1)
            idle_n = after["trtgraph_gpu_idle_seconds_per_step_count"]
            row["gpu_idle_us_per_step"] = 1e6 * after["trtgraph_gpu_idle_seconds_per_step_sum"] / idle_n if idle_n \
                else None
            outputs = row.pop("outputs")
            row["mismatches"] = sum(outputs[i] != want[i]["token_ids"] for i in want)
            rows.append(row)
            print(json.dumps(row), flush=True)
        (a.out / "metrics.txt").write_text(httpx.get(url + "/metrics", timeout=30).text)
    finally:
        proc.terminate()
        code = proc.wait(120)
    result = {"offline_tokens_per_second": summary["tokens_per_second"], "requests": len(reqs),
              "server_exit_code": code, "rates": rows}
    (a.out / "serve_bench.json").write_text(json.dumps(result, indent=2))
    print(f"\noffline run: {summary['tokens_per_second']:.1f} tokens/s over {len(reqs)} requests; "
          f"server exit code after SIGTERM: {code}")
    print("| rate (req/s) | tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | steps | step ms | "
          "GPU idle µs/step | mismatches |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        idle = "—" if r["gpu_idle_us_per_step"] is None else f"{r['gpu_idle_us_per_step']:.0f}"
        print(f"| {r['rate_rps'] or 'all at once'} | {r['tokens_per_second']:.1f} | {r['ttft_ms_p50']:.1f} | "
              f"{r['ttft_ms_p99']:.1f} | {r['tpot_ms_p50']:.2f} | {r['tpot_ms_p99']:.2f} | {r['steps']} | "
              f"{r['step_ms_mean']:.2f} | {idle} | {r['mismatches']} |")


if __name__ == "__main__":
    main()
