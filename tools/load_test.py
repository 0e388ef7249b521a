#!/usr/bin/env python3
"""Load-test the agent server on loopback: N concurrent clients for a bounded time.

Checks, not just timings:
  * every request gets either a full answer (200 with a finish reason and usage; streams end with [DONE]) or a
    429 with Retry-After -- nothing else;
  * no answer is lost, duplicated or crossed: greedy answers must equal a reference answer for their prompt
    computed before the load, response ids are unique, and the server's own counters (/metrics) account for
    exactly the requests and tokens the clients saw;
  * the server's memory stays flat (RSS sampled from /proc after a warm-up).

    python tools/load_test.py                          # spawns a server on a tiny random model
    python tools/load_test.py --model demo --clients 4 --duration 60
    python tools/load_test.py --url http://127.0.0.1:8000 --pid 1234
    python tools/load_test.py --model demo --head-of-line 5   # 3-token requests while a max-length one runs

Exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "Move the gripper to the red cup.",
    "List the objects on the table.",
    "Plan: pick up the screwdriver and hand it to the operator.",
    "Is the path to the charging dock clear?",
    "Summarise the last three sensor readings.",
    "Rotate the wrist by 30 degrees and report the torque.",
]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "step", "schema": {
    "type": "object",
    "properties": {"action": {"enum": ["move", "grasp", "wait"]}, "speed": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
    "required": ["action", "speed"], "additionalProperties": False}}}


@dataclass
class Result:
    kind: str                       # "chat", "stream", "json"
    prompt: int
    status: int
    seconds: float
    ttft: float | None = None
    text: str = ""
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish: str | None = None
    rid: str | None = None
    retry_after: str | None = None
    problem: str | None = None


@dataclass
class Stats:
    results: list[Result] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, r: Result) -> None:
        with self.lock:
            self.results.append(r)


def body_for(kind: str, prompt: int, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPTS[prompt]}], "max_tokens": max_tokens,
                            "temperature": 0}
    if kind == "stream":
        body.update(stream=True, stream_options={"include_usage": True})
    if kind == "json":
        body.update(response_format=JSON_FORMAT, max_tokens=64)
    return body


def one_request(client: httpx.Client, kind: str, prompt: int, max_tokens: int, timeout: float) -> Result:
    body = body_for(kind, prompt, max_tokens)
    t0 = time.monotonic()
    if kind != "stream":
        r = client.post("/v1/chat/completions", json=body, timeout=timeout)
        res = Result(kind, prompt, r.status_code, time.monotonic() - t0, retry_after=r.headers.get("retry-after"))
        if r.status_code == 200:
            data = r.json()
            res.text = data["choices"][0]["message"]["content"]
            res.finish = data["choices"][0]["finish_reason"]
            res.completion_tokens = data["usage"]["completion_tokens"]
            res.prompt_tokens = data["usage"]["prompt_tokens"]
            res.rid = data["id"]
        return res
    with client.stream("POST", "/v1/chat/completions", json=body, timeout=timeout) as r:
        res = Result(kind, prompt, r.status_code, 0.0, retry_after=r.headers.get("retry-after"))
        if r.status_code != 200:
            r.read()
            res.seconds = time.monotonic() - t0
            return res
        pieces, done, usage = [], False, None
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                res.problem = f"error event: {chunk['error']}"
                continue
            res.rid = chunk["id"]
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    if res.ttft is None:
                        res.ttft = time.monotonic() - t0
                    pieces.append(piece)
                if choice.get("finish_reason"):
                    res.finish = choice["finish_reason"]
        res.seconds = time.monotonic() - t0
        res.text = "".join(pieces)
        if not done or usage is None or res.finish is None:
            res.problem = f"incomplete stream (done={done}, usage={usage is not None}, finish={res.finish})"
        else:
            res.completion_tokens = usage["completion_tokens"]
            res.prompt_tokens = usage["prompt_tokens"]
    return res


def client_loop(url: str, headers: dict[str, str], stats: Stats, stop_at: float, seed: int, max_tokens: int,
                timeout: float) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, headers=headers) as client:
        while time.monotonic() < stop_at:
            kind = rng.choice(["chat", "chat", "stream", "stream", "json"])
            prompt = rng.randrange(len(PROMPTS))
            try:
                res = one_request(client, kind, prompt, max_tokens, timeout)
            except httpx.HTTPError as exc:
                res = Result(kind, prompt, 0, timeout, problem=f"transport: {exc!r}")
            stats.add(res)
            if res.status == 429:
                time.sleep(rng.uniform(0.05, 0.25))  # a real client would honour Retry-After; keep pressure up


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def scrape(url: str, headers: dict[str, str]) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=headers).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("edgespec:") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run(url: str, pid: int | None, clients: int, duration: float, max_tokens: int, api_key: str | None,
        timeout: float, warmup: float) -> int:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    failures: list[str] = []
    # Reference answers, one request at a time (greedy: the same prompt must always give the same answer).
    reference: dict[tuple[str, int], str] = {}
    with httpx.Client(base_url=url, headers=headers) as client:
        for kind in ("chat", "json"):
            for i in range(len(PROMPTS)):
                ref = one_request(client, kind, i, max_tokens, timeout)
                if ref.status != 200:
                    print(f"reference request failed: {ref}")
                    return 1
                reference[(kind, i)] = ref.text
    before = scrape(url, headers)
    stats = Stats()
    stop_at = time.monotonic() + duration
    threads = [threading.Thread(target=client_loop, args=(url, headers, stats, stop_at, seed, max_tokens, timeout),
                                daemon=True) for seed in range(clients)]
    t_start = time.monotonic()
    for t in threads:
        t.start()
    samples: list[tuple[float, float]] = []
    while any(t.is_alive() for t in threads):
        if pid is not None:
            value = rss_mb(pid)
            if value is not None:
                samples.append((time.monotonic() - t_start, value))
        time.sleep(0.5)
    wall = time.monotonic() - t_start
    after = scrape(url, headers)
    results = stats.results

    statuses = Counter(r.status for r in results)
    ok = [r for r in results if r.status == 200 and not r.problem]
    busy = [r for r in results if r.status == 429]
    other = [r for r in results if r not in ok and r not in busy]
    for r in other[:10]:
        failures.append(f"neither a full answer nor 429: {r.kind} status={r.status} {r.problem}")
    if len(other) > 10:
        failures.append(f"... and {len(other) - 10} more")
    missing_retry = [r for r in busy if not (r.retry_after or "").isdigit()]
    if missing_retry:
        failures.append(f"{len(missing_retry)} 429 answers without Retry-After")
    crossed = [r for r in ok if reference[("json" if r.kind == "json" else "chat", r.prompt)] != r.text]
    if crossed:
        failures.append(f"{len(crossed)} answers differ from the reference for their prompt, e.g. "
                        f"{crossed[0].kind} {crossed[0].text[:60]!r}")
    ids = [r.rid for r in ok]
    if len(set(ids)) != len(ids):
        failures.append(f"duplicate response ids: {len(ids) - len(set(ids))}")

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    served = sum(v for k, v in after.items() if k.startswith("edgespec:request_success_total")) - \
        sum(v for k, v in before.items() if k.startswith("edgespec:request_success_total"))
    refused = delta('edgespec:request_failure_total{reason="queue_full"}')
    gen_tokens = delta("edgespec:generation_tokens_total")
    if served != len(ok) + sum(1 for r in other if r.status == 200):
        failures.append(f"server finished {served:.0f} requests, clients received {len(ok)} full answers")
    if refused != len(busy):
        failures.append(f"server refused {refused:.0f} requests, clients saw {len(busy)} 429s")
    client_tokens = sum(r.completion_tokens for r in ok)
    if gen_tokens != client_tokens:
        failures.append(f"server generated {gen_tokens:.0f} tokens, clients received {client_tokens}")
    drafts = delta("edgespec:spec_decode_num_drafts_total")
    accepted = delta("edgespec:spec_decode_num_accepted_tokens_total")

    lat = [r.seconds for r in ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    print(f"clients: {clients}   duration: {wall:.1f}s   requests: {len(results)}   "
          f"statuses: {dict(sorted(statuses.items()))}")
    print(f"full answers: {len(ok)} ({len(ok) / wall:.2f}/s)   429: {len(busy)}   other: {len(other)}   "
          f"by kind: {dict(Counter(r.kind for r in ok))}")
    print(f"latency s (full answers): p50 {pct(lat, 0.5):.3f}  p95 {pct(lat, 0.95):.3f}  p99 {pct(lat, 0.99):.3f}  "
          f"max {max(lat, default=float('nan')):.3f}   stream TTFT p50 {pct(ttft, 0.5):.3f}  p95 {pct(ttft, 0.95):.3f}")
    print(f"tokens generated: {client_tokens} ({client_tokens / wall:.1f} tok/s)   server counted: {gen_tokens:.0f}   "
          f"acceptance length: {1 + accepted / drafts if drafts else 1.0:.2f}")
    print(f"accounting: server finished {served:.0f} / refused {refused:.0f}; clients got {len(ok)} answers / "
          f"{len(busy)} 429s; unique ids {len(set(ids))}/{len(ids)}; answers differing from reference: "
          f"{len(crossed)}")
    if samples:
        steady = [v for t, v in samples if t >= warmup] or [v for _, v in samples]
        first, last, peak = steady[0], steady[-1], max(v for _, v in samples)
        growth = last - first
        print(f"server RSS MB: start {samples[0][1]:.1f}  after warm-up {first:.1f}  end {last:.1f}  peak {peak:.1f}  "
              f"growth after warm-up {growth:+.1f} ({len(samples)} samples)")
        if growth > max(32.0, 0.1 * first):
            failures.append(f"RSS grew by {growth:.1f} MB after warm-up")
    if failures:
        for f in failures:
            print(f"FAIL {f}")
        return 1
    print("OK: every request got a full answer or a 429; nothing lost, duplicated or crossed; RSS flat")
    return 0


def head_of_line(url: str, shorts: int, api_key: str | None, timeout: float, limit_s: float = 2.0) -> int:
    """Send one request whose max_tokens fills the whole context left after its prompt, then, while it runs,
    ``shorts`` 3-token requests one after another; each must be answered within ``limit_s`` (a robot controller's
    next action must not wait behind a long generation). Exits 1 otherwise."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    # A raw prompt that small models continue for a long time (a chat answer may end after a few dozen tokens).
    long_body: dict[str, Any] = {"prompt": ", ".join(str(i) for i in range(1, 25)) + ","}
    with httpx.Client(base_url=url, headers=headers, timeout=timeout) as client:
        max_len = client.get("/v1/models").json()["data"][0]["max_model_len"]
        probe = client.post("/v1/completions", json={**long_body, "max_tokens": 1}).json()
        room = max_len - probe["usage"]["prompt_tokens"]
        box: dict[str, Any] = {}

        def long_request() -> None:
            t0 = time.monotonic()
            r = client.post("/v1/completions", json={**long_body, "max_tokens": room})
            box["status"], box["seconds"] = r.status_code, time.monotonic() - t0
            box["tokens"] = r.json().get("usage", {}).get("completion_tokens") if r.status_code == 200 else None

        runner = threading.Thread(target=long_request)
        runner.start()
        while client.get("/health").json().get("running") != 1 and runner.is_alive():
            time.sleep(0.01)
        time.sleep(0.5)     # the long request is past its prefill, decoding
        waits, queues = [], []
        for i in range(shorts):
            t0 = time.monotonic()
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": PROMPTS[i % 6]}],
                                                          "max_tokens": 3})
            waits.append(time.monotonic() - t0)
            queues.append(r.json()["edgespec"]["queue_ms"] / 1000.0 if r.status_code == 200 else float("nan"))
            if not runner.is_alive():
                break
        still_running = runner.is_alive()
        runner.join()
    print(f"long request: max_tokens {room} (max_model_len {max_len}), status {box.get('status')}, "
          f"{box.get('tokens')} tokens in {box.get('seconds', float('nan')):.1f}s; running during all short "
          f"requests: {still_running}")
    print(f"3-token requests: {len(waits)}   answer s: max {max(waits):.3f}  p50 {pct(waits, 0.5):.3f}   "
          f"queue wait s: max {max(queues):.3f}  p50 {pct(queues, 0.5):.3f}")
    if not still_running or box.get("status") != 200 or max(waits) > limit_s:
        print(f"FAIL: a short request waited more than {limit_s}s, or the long one did not run throughout")
        return 1
    print(f"OK: every 3-token request answered within {limit_s}s while the max-length request ran")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="test a running server instead of spawning one")
    ap.add_argument("--pid", type=int, help="server process id for RSS sampling (with --url)")
    ap.add_argument("--api-key")
    ap.add_argument("--model", default="tiny", help="model of the spawned server: tiny (random), demo, or a folder")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--warmup", type=float, default=10.0, help="seconds before RSS counts as steady")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-queue", type=int, default=4, help="spawned server's max_queue")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--head-of-line", type=int, metavar="N", default=0,
                    help="instead of the load: N 3-token requests while one max-length request runs (each <= 2 s)")
    ap.add_argument("--max-seq-len", type=int, default=1024, help="spawned server's max_seq_len")
    args = ap.parse_args(argv)
    if args.url and args.head_of_line:
        return head_of_line(args.url, args.head_of_line, args.api_key, args.timeout)
    if args.url:
        return run(args.url, args.pid, args.clients, args.duration, args.max_tokens, args.api_key, args.timeout,
                   args.warmup)

    # The tiny chat model and the server subprocess are test helpers (tests/serving_helpers.py), not package code.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from serving_helpers import ServerProcess, write_tiny_chat_model

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            model = str(write_tiny_chat_model(Path(tmp) / "tiny"))
        server = ServerProcess(model, env={"OMP_NUM_THREADS": "1"}, log_path=Path(tmp) / "server.log",
                               drafter="ngram", max_seq_len=args.max_seq_len, max_queue=args.max_queue,
                               log_level="warning", request_timeout_s=args.timeout)
        with server:
            if args.head_of_line:
                code = head_of_line(server.url, args.head_of_line, None, args.timeout)
            else:
                code = run(server.url, server.pid, args.clients, args.duration, args.max_tokens, None,
                           args.timeout, args.warmup)
        print(f"server exit status after SIGTERM: {server.returncode}")
        return code or (1 if server.returncode != 0 else 0)


if __name__ == "__main__":
    sys.exit(main())
