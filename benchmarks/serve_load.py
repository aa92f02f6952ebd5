"""`captioner serve` under load: 200 caption requests from 4 concurrent clients to 127.0.0.1 (and 50 from one client,
for comparison), with the bundled model and beam 3. Reports latency p50/p95, requests/s, failures, and the server's
resident memory: after a warm-up, after each half of the 200, and its peak. Linux only (it reads /proc).

    python benchmarks/serve_load.py

Bounded: each request may take 60 s, the whole run 10 minutes; what did not finish by then counts as failed.
"""

from __future__ import annotations

import io
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from common import machine, table

from captioner.data.shapes import ShapesDataset

REQUESTS, CLIENTS, DEADLINE = 200, 4, 600


def memory_mib(pid: int, field: str) -> float:
    """VmRSS (resident now) or VmHWM (the peak so far) of a process, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def start_server() -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "captioner.cli", "serve", "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def main() -> None:
    print(f"# serve_load.py on {machine()}\n")
    split = ShapesDataset("test", 16, seed=2)
    images = []
    for i in range(len(split)):
        buffer = io.BytesIO()
        split.load_image(i).save(buffer, format="PNG")
        images.append(buffer.getvalue())
    process, url = start_server()
    try:
        load(url, images, 16, 4)  # warm-up
        memory = {"after warm-up": memory_mib(process.pid, "VmRSS")}
        rows = []
        for requests, clients in ((REQUESTS, CLIENTS), (50, 1)):
            start = time.perf_counter()
            half = (lambda: memory.__setitem__("after 100", memory_mib(process.pid, "VmRSS"))) if clients > 1 else None
            latencies, failures = load(url, images, requests, clients, half)
            seconds = time.perf_counter() - start
            if clients > 1:
                memory["after 200"] = memory_mib(process.pid, "VmRSS")
            quantiles = statistics.quantiles(latencies, n=20)
            rows.append(
                {
                    "requests": requests,
                    "clients": clients,
                    "p50 (ms)": f"{statistics.median(latencies) * 1000:.0f}",
                    "p95 (ms)": f"{quantiles[18] * 1000:.0f}",
                    "requests/s": f"{len(latencies) / seconds:.1f}",
                    "failed": failures,
                }
            )
        memory["peak"] = memory_mib(process.pid, "VmHWM")
    finally:
        process.terminate()
        process.wait(timeout=30)
    print(table(rows))
    print("\nserver resident memory (MiB): " + ", ".join(f"{k} {v:.0f}" for k, v in memory.items()))


if __name__ == "__main__":
    main()
