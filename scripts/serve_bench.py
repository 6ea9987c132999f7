"""`trtgraph serve` under load: the offline `trtgraph run` throughput, then the same prompts
sent to a live server as streaming completions with Poisson arrivals at several request
rates (and all at once): throughput, TTFT and TPOT p50 / p99 per rate, every response
checked token for token against the offline run.

    python scripts/serve_bench.py --manifest ART --prompts p.jsonl --rates 4,16,64 --out OUT_DIR

Writes OUT_DIR/serve_bench.json and prints a table. Prompts: a JSONL as `trtgraph run` reads
(scripts/make_prompts.py writes one).
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
import openai


def percentile(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else float("nan")


def offline(manifest: str, prompts: Path, out_dir: Path) -> tuple[dict, dict]:
    out, summary = out_dir / "offline.jsonl", out_dir / "offline_summary.json"
    subprocess.run([sys.executable, "-m", "trtgraph", "run", "--prompts", str(prompts), "--manifest", manifest,
                    "--output", str(out), "--summary-json", str(summary)], check=True)
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    return results, json.loads(summary.read_text())


def body_of(req: dict) -> dict:
    body = {k: v for k, v in req.items() if k in ("max_tokens", "temperature", "top_p", "seed", "stop")}
    body["prompt"] = req.get("prompt", req.get("prompt_token_ids"))
    if "top_k" in req:
        body["extra_body"] = {"top_k": req["top_k"]}
    return body


async def one(client, model: str, req: dict, start_at: float, t_zero: float) -> dict:
    await asyncio.sleep(max(0.0, t_zero + start_at - time.perf_counter()))
    t0 = time.perf_counter()
    stream = await client.completions.create(model=model, stream=True, **body_of(req))
    times, toks = [], []
    async for ch in stream:
        times.append(time.perf_counter())
        toks += ch.choices[0].token_ids
    return {"id": req["id"], "token_ids": toks, "ttft_s": times[0] - t0,
            "tpot_s": (times[-1] - times[0]) / max(len(toks) - 1, 1), "end": times[-1]}


async def at_rate(url: str, model: str, reqs: list[dict], rate: float | None) -> dict:
    rng = random.Random(0)
    arrivals, t = [], 0.0
    for _ in reqs:
        arrivals.append(t)
        t += rng.expovariate(rate) if rate else 0.0
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=3600,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=4096),
                                                              timeout=3600))
    t_zero = time.perf_counter()
    done = await asyncio.gather(*(one(client, model, r, a, t_zero) for r, a in zip(reqs, arrivals)))
    wall = max(d["end"] for d in done) - t_zero
    tokens = sum(len(d["token_ids"]) for d in done)
    return {"rate_rps": rate, "requests": len(done), "seconds": wall, "tokens_per_second": tokens / wall,
            "ttft_ms_p50": 1e3 * percentile([d["ttft_s"] for d in done], .5),
            "ttft_ms_p99": 1e3 * percentile([d["ttft_s"] for d in done], .99),
            "tpot_ms_p50": 1e3 * percentile([d["tpot_s"] for d in done], .5),
            "tpot_ms_p99": 1e3 * percentile([d["tpot_s"] for d in done], .99),
            "outputs": {d["id"]: d["token_ids"] for d in done}}


def start_server(manifest: str, port: int, max_waiting: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "trtgraph", "serve", "--manifest", manifest, "--port", str(port),
                             "--max-waiting", str(max_waiting)], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.time() + 1800
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
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
    proc = start_server(a.manifest, port, max_waiting=len(reqs) + 1)
    url = f"http://127.0.0.1:{port}"
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rows = []
    try:
        for rate in [float(r) for r in a.rates.split(",")]:
            row = asyncio.run(at_rate(url, model, reqs, rate or None))
            outputs = row.pop("outputs")
            row["mismatches"] = sum(outputs[i] != want[i]["token_ids"] for i in want)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        proc.terminate()
        code = proc.wait(120)
    result = {"offline_tokens_per_second": summary["tokens_per_second"], "requests": len(reqs),
              "server_exit_code": code, "rates": rows}
    (a.out / "serve_bench.json").write_text(json.dumps(result, indent=2))
    print(f"\noffline run: {summary['tokens_per_second']:.1f} tokens/s over {len(reqs)} requests; "
          f"server exit code after SIGTERM: {code}")
    print("| rate (req/s) | tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | mismatches |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate_rps'] or 'all at once'} | {r['tokens_per_second']:.1f} | {r['ttft_ms_p50']:.1f} | "
              f"{r['ttft_ms_p99']:.1f} | {r['tpot_ms_p50']:.2f} | {r['tpot_ms_p99']:.2f} | {r['mismatches']} |")


if __name__ == "__main__":
    main()
