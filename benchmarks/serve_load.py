"""`captioner serve` under load: 200 caption requests from 4 concurrent clients to 127.0.0.1 (and 50 from one client,
for comparison), with the bundled model, beam 3 and the server's default limits. Then the same 200 requests again,
beside hostile clients:

- 8 clients that send a 9,400x9,400 PNG (86 KB, 88 megapixels: under PIL's bomb limit, over the server's 25);
- 4 clients that send a form whose file never ends, chunked (no Content-Length), up to 512 MB each;
- 64 connections stalled halfway: 32 in the request's head, 32 in its body (opened again when the server closes one).

Reports latency p50/p95, requests/s and failures of the normal requests; for each hostile kind, how it was answered
and the longest it took to be answered or cut off; the server's resident memory (after a warm-up, after the quiet
200, and its peak) and what it wrote to disk. Linux only (it reads /proc).

    python benchmarks/serve_load.py

Bounded: each request may take 60 s, each phase 10 minutes; what did not finish by then counts as failed.
"""

from __future__ import annotations

import collections
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import httpx
from common.harness import Script, memory_mib
from PIL import Image

from captioner.data.shapes import ShapesDataset

REQUESTS, CLIENTS, DEADLINE = 200, 4, 600
BIG_SIDE, BIG_CLIENTS, CHUNKED_CLIENTS, STALLED = 9400, 8, 4, 64
PACE = 1.0  # seconds between one hostile client's requests (0: as fast as the server answers)
HOSTILE_SECONDS = 45  # the hostile clients go on at least this long: past the server's 30 s timeout
FILE_PART = b'--xyz\r\nContent-Disposition: form-data; name="image"; filename="x.png"\r\n\r\n'
FORM = "multipart/form-data; boundary=xyz"


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_writes(pid: int) -> int:
    """Bytes the process has caused to be written to storage (its temporary files included)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("write_bytes:"):
            return int(line.split()[1])
    raise KeyError("write_bytes")


def start_server(log: IO[str]) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "captioner.cli", "serve", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)  # its access log: one line a request
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise SystemExit("captioner serve did not come up within 2 minutes")


def load(url: str, images: list[bytes], requests: int, clients: int, on_half=None) -> tuple[list[float], int]:
    """Send `requests` requests from `clients` threads; returns each answered request's seconds, and the failures."""
    latencies: list[float] = []
    failures, sent, lock = 0, 0, threading.Lock()
    stop = time.monotonic() + DEADLINE

    def client() -> None:
        nonlocal failures, sent
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < stop:
                with lock:
                    if sent == requests:
                        return
                    sent += 1
                    if sent == requests // 2 + 1 and on_half:
                        on_half()
                    image = images[sent % len(images)]
                start = time.perf_counter()
                try:
                    ok = http.post(f"{url}/api/caption", files={"image": ("x.png", image)}, data={"beam_size": 3})
                    ok = ok.status_code == 200 and bool(ok.json()["tokens"])
                except httpx.HTTPError:
                    ok = False
                with lock:
                    if ok:
                        latencies.append(time.perf_counter() - start)
                    else:
                        failures += 1

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies, failures + requests - sent


class Hostile:
    """The hostile clients, each in its own thread until `stop` is set; every outcome is recorded by kind as (how
    it ended, seconds from its last byte sent to the answer or the cut)."""

    def __init__(self, url: str):
        self.url, self.stop = url, threading.Event()
        self.host, port = url.removeprefix("http://").split(":")
        self.port = int(port)
        self.outcomes: dict[str, list[tuple[str, float]]] = collections.defaultdict(list)
        self.most_sent = 0  # the most bytes of one endless upload sent (into the kernel's socket buffers too)
        self.lock = threading.Lock()
        buffer = io.BytesIO()
        Image.new("RGB", (BIG_SIDE, BIG_SIDE), (200, 40, 40)).save(buffer, format="PNG", optimize=True)
        self.big_png = buffer.getvalue()

    def record(self, kind: str, outcome: str, seconds: float) -> None:
        with self.lock:
            self.outcomes[kind].append((outcome, seconds))

    def big_images(self) -> None:
        with httpx.Client(timeout=60) as http:
            while not self.stop.wait(PACE):
                start = time.perf_counter()
                try:
                    response = http.post(f"{self.url}/api/caption", files={"image": ("big.png", self.big_png)})
                    outcome = str(response.status_code)
                except httpx.HTTPError as err:
                    outcome = type(err).__name__
                seconds = time.perf_counter() - start
                self.record(f"{BIG_SIDE}² PNG ({len(self.big_png) / 1024:.0f} KB)", outcome, seconds)

    def endless_uploads(self) -> None:
        while not self.stop.wait(PACE):
            sent, last = 0, time.perf_counter()

            def body():
                nonlocal sent, last
                yield FILE_PART
                for _ in range(512 * 16):  # 512 MB
                    sent += 2**16
                    last = time.perf_counter()
                    yield b"\0" * 2**16

            try:
                response = httpx.post(
                    f"{self.url}/api/caption", content=body(), headers={"content-type": FORM}, timeout=60
                )
                outcome = str(response.status_code)
            except httpx.HTTPError as err:
                outcome = type(err).__name__
            self.record("endless chunked form", outcome, time.perf_counter() - last)
            with self.lock:
                self.most_sent = max(self.most_sent, sent)

    def stalled(self, in_body: bool) -> None:
        head = f"POST /api/caption HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: {FORM}\r\n"
        stall = (head + "Content-Length: 1000000\r\n\r\n" if in_body else head).encode()
        stall += FILE_PART + b"\0" * 1000 if in_body else b""
        while not self.stop.is_set():
            try:
                client = socket.create_connection((self.host, self.port))
            except OSError as err:
                self.record("stalled, could not connect", type(err).__name__, 0.0)
                time.sleep(1)
                continue
            with client:
                client.sendall(stall)
                start = time.perf_counter()
                client.settimeout(1.0)
                answer = b""
                while not self.stop.is_set():
                    try:
                        chunk = client.recv(4096)
                    except TimeoutError:
                        continue
                    except OSError:
                        chunk = b""
                    if not chunk:
                        status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "closed"
                        kind = "stalled in the body" if in_body else "stalled in the head"
                        self.record(kind, status, time.perf_counter() - start)
                        break
                    answer += chunk

    def start(self) -> list[threading.Thread]:
        targets = [self.big_images] * BIG_CLIENTS + [self.endless_uploads] * CHUNKED_CLIENTS
        targets += [lambda: self.stalled(True)] * (STALLED // 2) + [lambda: self.stalled(False)] * (STALLED // 2)
        threads = [threading.Thread(target=target, daemon=True) for target in targets]
        for thread in threads:
            thread.start()
        return threads

    def summary(self) -> list[dict]:
        rows = []
        for kind, outcomes in self.outcomes.items():
            counts = collections.Counter(outcome for outcome, _ in outcomes)
            rows.append(
                {
                    "hostile requests": kind,
                    "answers": ", ".join(f"{n} x {outcome}" for outcome, n in counts.most_common()),
                    "longest to answer or cut (s)": f"{max(seconds for _, seconds in outcomes):.1f}",
                }
            )
        return rows


def row(requests: int, clients: int, latencies: list[float], failures: int, seconds: float, label: str) -> dict:
    answered = len(latencies) >= 2
    return {
        "phase": label,
        "requests": requests,
        "clients": clients,
        "p50 (ms)": f"{statistics.median(latencies) * 1000:.0f}" if answered else "-",
        "p95 (ms)": f"{statistics.quantiles(latencies, n=20)[18] * 1000:.0f}" if answered else "-",
        "requests/s": f"{len(latencies) / seconds:.1f}",
        "failed": failures,
    }


def main() -> None:
    script = Script(__file__, __doc__)
    script.start()
    split = ShapesDataset("test", 16, seed=2)
    images = []
    for i in range(len(split)):
        buffer = io.BytesIO()
        split.load_image(i).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 (read after the server stops)
    process, url = start_server(log)
    try:
        load(url, images, 16, 4)  # warm-up
        memory = {"after warm-up": memory_mib(process.pid, "VmRSS")}
        rows = script.table("serve_load", "requests to `captioner serve`")
        cpu = {}  # phase -> (seconds, CPU seconds of the server, CPU seconds of this process: the clients)
        for requests, clients in ((REQUESTS, CLIENTS), (50, 1)):
            start, used = time.perf_counter(), (cpu_seconds(process.pid), time.process_time())
            half = (lambda: memory.__setitem__("after 100", memory_mib(process.pid, "VmRSS"))) if clients > 1 else None
            latencies, failures = load(url, images, requests, clients, half)
            seconds = time.perf_counter() - start
            rows.add(row(requests, clients, latencies, failures, seconds, "quiet"))
            if clients > 1:
                memory["after 200"] = memory_mib(process.pid, "VmRSS")
                cpu["quiet"] = (seconds, cpu_seconds(process.pid) - used[0], time.process_time() - used[1])

        hostile = Hostile(url)
        written = disk_writes(process.pid)
        start, used = time.perf_counter(), (cpu_seconds(process.pid), time.process_time())
        threads = hostile.start()
        latencies, failures = load(url, images, REQUESTS, CLIENTS)
        seconds = time.perf_counter() - start
        rows.add(row(REQUESTS, CLIENTS, latencies, failures, seconds, "beside hostile clients"))
        cpu["beside hostile clients"] = (seconds, cpu_seconds(process.pid) - used[0], time.process_time() - used[1])
        time.sleep(max(0.0, HOSTILE_SECONDS - (time.perf_counter() - start)))
        hostile.stop.set()
        for thread in threads:
            thread.join(timeout=90)
        written = disk_writes(process.pid) - written
        memory["peak"] = memory_mib(process.pid, "VmHWM")
    finally:
        exit_code = process.poll()
        process.terminate()
        process.wait(timeout=30)
        log.seek(0)
        lines = log.read()
        if exit_code is not None:
            print(f"the server stopped early, exit code {exit_code}:\n{lines[-3000:]}")
    rows.finish()
    hostile_rows = script.table("serve_load_hostile", "the hostile clients: how each kind was answered")
    for outcome in hostile.summary():
        hostile_rows.add(outcome)
    server = script.table("serve_load_server", "the server")
    if rows.rows[2]["p95 (ms)"] != "-":
        ratio = float(rows.rows[2]["p95 (ms)"]) / float(rows.rows[0]["p95 (ms)"])
        server.add({"figure": "p95 beside the hostile clients / quiet p95", "value": f"{ratio:.2f}x"})
    endless = len(hostile.outcomes["endless chunked form"])
    most = f"{hostile.most_sent / 2**20:.1f} MB"
    server.add({"figure": "the most of one endless upload sent before its answer or cut", "value": most})
    per_upload = f"{written / 2**20:.0f} MB, {written / 2**20 / max(endless, 1):.1f} MB per endless upload"
    server.add({"figure": "written to disk while the hostile clients ran", "value": per_upload})
    for phase, (seconds, busy, clients) in cpu.items():
        cores = f"server {busy / seconds:.2f} cores, clients {clients / seconds:.2f} cores"
        server.add({"figure": f"CPU, {phase}, 200 requests", "value": cores})
    for moment, mib in memory.items():
        server.add({"figure": f"resident memory, {moment}", "value": f"{mib:.0f} MiB"})
    server.add({"figure": "tracebacks in the server's log", "value": lines.count("Traceback")})
    script.finish()


if __name__ == "__main__":
    main()
