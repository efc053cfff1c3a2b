"""Whole-service memory of the cpu profile: ``chimera serve`` (every family, the VLM's vLLM server included)
started through bench/served.py, measured after /readyz and again after one chat answer, one speech synthesis and
one video job. Prints the process tree's summed RSS (bytes resident, shared pages counted once per process that
maps them: an over-count) and summed PSS (each shared page split between its processes: the tree's real share of
memory), in GiB and GB. Run: ``.venv/bin/python bench/service_memory.py`` (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.served import ServedChimera  # noqa: E402

GIB = 2**30


def tree_memory(pid: int) -> tuple[int, int, int]:
    """(summed RSS bytes, summed PSS bytes, process count) of ``pid`` and all its descendants."""
    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    rss = pss = 0
    for p in procs:
        try:
            m = p.memory_full_info()
            rss, pss = rss + m.rss, pss + m.pss
        except psutil.Error:
            pass
    return rss, pss, len(procs)


def main() -> int:
    """Start the cpu service, print its memory after ready and after one request per family. Returns 0."""
    svc = ServedChimera("cpu")
    try:
        base = svc.base
        ready = tree_memory(svc.proc.pid)
        httpx.post(f"{base}/v1/chat/completions", timeout=300,
                   json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}).raise_for_status()
        httpx.post(f"{base}/v1/audio/speech", timeout=300,
                   json={"input": "Hello there.", "response_format": "wav"}).raise_for_status()
        job = httpx.post(f"{base}/v1/videos", timeout=60,
                         json={"prompt": "a red square", "seconds": "4", "size": "64x64"}).json()
        for _ in range(1200):  # a hang guard: the job takes seconds
            if httpx.get(f"{base}/v1/videos/{job['id']}", timeout=30).json()["status"] in ("completed", "failed"):
                break
            time.sleep(0.5)
        used = tree_memory(svc.proc.pid)
        print(f"whole cpu service, {used[2]} processes: after ready RSS {ready[0] / GIB:.2f} GiB, PSS "
              f"{ready[1] / GIB:.2f} GiB; after one chat, one speech and one video job RSS {used[0] / GIB:.2f} GiB, "
              f"PSS {used[1] / GIB:.2f} GiB ({used[1] / 1e9:.2f} GB)")
    finally:
        svc.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
