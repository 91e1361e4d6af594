#!/usr/bin/env python3
"""Does one client's oversize prompt stall everyone else on `tandem serve`?

Starts `tandem serve` on a model, keeps a streaming completion running, then
sends N prompts of --bytes bytes at once (3.9 MB: under the 4 MiB body limit,
far over any context) while polling /health. For each N it prints the
stream's longest pause between two events, /health's worst latency and what
the oversize requests got, beside the same figures with no oversize prompt.

    scripts/serve-stall.py [--tandem target/release/tandem] [--model smollm2-135m]
                           [--counts 2,4] [--bytes 3900000] [--port 8097]

Only the Python standard library; the binary is any build of `tandem`, so the
same script measures an older commit's binary for comparison.
"""

import argparse
import http.client
import json
import random
import subprocess
import sys
import threading
import time


def request(port, method, path, body=None, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


class Streamer(threading.Thread):
    """Streams completions back to back; records the gaps between events of one stream."""

    def __init__(self, port, model):
        super().__init__(daemon=True)
        self.port, self.model = port, model
        self.stop = threading.Event()
        self.gaps = []  # (time of the later event, gap in seconds)

    def run(self):
        body = json.dumps(
            {"model": self.model, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True}
        )
        while not self.stop.is_set():
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
            conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            last = None
            while not self.stop.is_set():
                line = resp.readline()
                if not line:
                    break
                if line.startswith(b"data:"):
                    now = time.monotonic()
                    if last is not None:
                        self.gaps.append((now, now - last))
                    last = now
                    if line.strip() == b"data: [DONE]":
                        break
            conn.close()

    def longest_gap(self, start, end):
        return max((g for t, g in self.gaps if start <= t <= end), default=0.0)


class HealthPoller(threading.Thread):
    def __init__(self, port):
        super().__init__(daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.latencies = []

    def run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                status, _ = request(self.port, "GET", "/health", timeout=60)
                ok = status == 200
            except OSError:
                ok = False
            self.latencies.append(time.monotonic() - t0 if ok else float("inf"))
            time.sleep(0.05)


def oversize_prompt(n_bytes, seed):
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    out, size = [], 0
    while size < n_bytes:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_bytes]


def measure(port, model, count, prompt):
    streamer, poller = Streamer(port, model), HealthPoller(port)
    streamer.start()
    time.sleep(2.0)  # the stream is running
    poller.start()
    start = time.monotonic()
    results = [None] * count
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4})

    def send(i):
        t0 = time.monotonic()
        status, data = request(port, "POST", "/v1/completions", body=body)
        message = json.loads(data).get("error", {}).get("message", "")[:110] if status != 200 else ""
        results[i] = (status, time.monotonic() - t0, message)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for s in senders:
        s.start()
    for s in senders:
        s.join()
    time.sleep(1.0)  # a pause right after the last answer still counts
    end = time.monotonic()
    poller.stop.set()
    poller.join()
    streamer.stop.set()
    pause = streamer.longest_gap(start, end)
    health = max(poller.latencies, default=float("nan"))
    return pause, health, results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tandem", default="target/release/tandem")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--counts", default="2,4")
    ap.add_argument("--bytes", type=int, default=3_900_000)
    ap.add_argument("--port", type=int, default=8097)
    args = ap.parse_args()

    server = subprocess.Popen(
        [args.tandem, "serve", "--model", args.model, "--port", str(args.port), "--model-id", "m", "--backend", "cpu"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if request(args.port, "GET", "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not start: {server.stderr.read().decode()}")
            time.sleep(0.2)
        prompt = oversize_prompt(args.bytes, seed=7)
        print(f"{args.tandem}, {args.model}, oversize prompts of {len(prompt)} bytes")
        for count in [0] + [int(c) for c in args.counts.split(",")]:
            pause, health, results = measure(args.port, "m", count, prompt)
            answers = ", ".join(f"{s} in {t:.2f} s" for s, t, _ in results) or "-"
            print(f"{count} oversize: stream's longest pause {pause:.2f} s, /health worst {health:.3f} s; answers: {answers}")
            if results and results[0][2]:
                print(f"  ({results[0][2]})")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
