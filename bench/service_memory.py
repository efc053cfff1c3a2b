"""Whole-service memory of the cpu profile: ``chimera serve`` (every family, the VLM's vLLM server included)
started through bench/served.py, measured after /readyz and again after one chat answer, one speech synthesis and
one video job. Prints the process tree's summed RSS (bytes resident, shared pages counted once per process that
maps them: an over-count) and summed PSS (each shared page split between its processes: the tree's real share of
memory), in GiB and GB. Run: ``.venv/bin/python bench/service_memory.py`` (about 2 minutes on 2 cores)."""
import sys, time
sys.path.insert(0, ".")
import httpx, psutil
from bench.served import ServedChimera

def tree(pid):
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)

def sums(pid):
    rss = pss = 0
    for p in tree(pid):
        try:
            m = p.memory_full_info()
            rss += m.rss; pss += m.pss
        except psutil.Error:
            pass
    return rss, pss

s = ServedChimera("cpu")
try:
    b = s.base
    r0 = sums(s.proc.pid)
    httpx.post(f"{b}/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}, timeout=300)
    httpx.post(f"{b}/v1/audio/speech", json={"input": "Hello there.", "response_format": "wav"}, timeout=300)
    v = httpx.post(f"{b}/v1/videos", json={"prompt": "a red square", "seconds": "4", "size": "64x64"}, timeout=60).json()
    for _ in range(600):
        if httpx.get(f"{b}/v1/videos/{v['id']}", timeout=30).json()["status"] in ("completed", "failed"):
            break
        time.sleep(0.5)
    r1 = sums(s.proc.pid)
    G = 2**30
    print(f"whole cpu service, {len(tree(s.proc.pid))} processes: after ready RSS {r0[0]/G:.2f} GiB, PSS {r0[1]/G:.2f} GiB; "
          f"after one chat, one speech and one video job RSS {r1[0]/G:.2f} GiB, PSS {r1[1]/G:.2f} GiB ({r1[1]/1e9:.2f} GB)")
finally:
    s.stop()
