"""The engine-process supervisor (services/engines/process.py) and its group guard (services/engines/guard.py),
with a scripted stand-in server.

The stand-in answers ``GET /health`` like vLLM's OpenAI server and, like it, spawns a worker process of its own
(vLLM's engine core), so the tests can check that no process of the group outlives the supervisor's will: after
a crash, a stop, or the supervising process being SIGKILLed. No model is involved (the supervisor never looks at
one); the real vLLM server is exercised by tests/test_vlm_vllm.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from services.engines.process import ServerProcess, ServerSpec

STAND_IN = textwrap.dedent('''
    import argparse, http.server, os, subprocess, sys
    ap = argparse.ArgumentParser()
    ap.add_argument("--host"); ap.add_argument("--port", type=int); ap.add_argument("--exit-at-once", action="store_true")
    a = ap.parse_args()
    if a.exit_at_once:
        sys.exit(3)
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's engine core
    with open(os.environ["WORKER_PIDS"], "a") as f:
        f.write(f"{os.getpid()} {worker.pid}\\n")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer((a.host, a.port), H).serve_forever()
''')


# Every wait below is bounded by this ceiling on time.monotonic(). A ceiling only turns a hang into a failure (a
# passing wait returns as soon as its condition holds), so it is generous: the tests run beside other load on a
# 2-core machine, where 30 s once ran out while the processes were still being reaped.
CEILING_S = 120.0


def wait_until(cond, timeout: float = CEILING_S) -> bool:
    """Poll ``cond`` every 0.1 s until true or ``timeout`` seconds of time.monotonic() (a bound on a failure, not
    a timing claim)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its parent has not reaped it yet
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def group_members(pgid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getpgid(int(name)) == pgid and alive(int(name)):
                    out.append(int(name))
            except (ProcessLookupError, FileNotFoundError):
                continue
    return out


@pytest.fixture
def spec(tmp_path):
    (tmp_path / "stand_in_engine.py").write_text(STAND_IN)
    pids = tmp_path / "pids.txt"
    pids.touch()
    return ServerSpec(python=sys.executable, module="stand_in_engine",
                      env={"PYTHONPATH": str(tmp_path), "WORKER_PIDS": str(pids)},
                      startup_timeout_s=CEILING_S, health_period_s=0.2, health_timeout_s=2.0, max_health_failures=2, max_start_failures=2)


def pids_of(spec) -> list[tuple[int, int]]:
    text = open(spec.env["WORKER_PIDS"]).read().split()
    return [(int(a), int(b)) for a, b in zip(text[::2], text[1::2])]


def test_starts_restarts_after_death_and_stops_the_whole_group(spec):
    s = ServerProcess(spec).start()
    try:
        assert s.wait_ready(CEILING_S) and s.state == "ready"
        assert httpx.get(f"{s.base_url}/health").status_code == 200
        pgid = s.pid
        (server, worker), = pids_of(spec)
        assert s.server_pid == server and os.getpgid(worker) == pgid
        os.kill(server, signal.SIGKILL)  # the engine dies; its worker would linger without the guard
        assert wait_until(lambda: s.state != "ready")
        assert wait_until(lambda: not alive(worker))
        assert s.wait_ready(CEILING_S) and s.restarts == 1 and s.base_url.endswith(f":{s.port}")
        assert len(pids_of(spec)) == 2 and s.server_pid == pids_of(spec)[1][0] != server
        assert s.last_error == "engine process exited with code 137"  # the guard reports its command's SIGKILL
    finally:
        log = s.log_path
        s.stop()
    assert s.state == "stopped" and s.pid is None
    assert not os.path.exists(log)  # its temporary log goes with it (they piled up in /tmp before)
    assert wait_until(lambda: not group_members(pgid) and not group_members(s._proc.pid))
    assert not any(alive(p) for pair in pids_of(spec) for p in pair)


def test_a_server_that_stops_answering_health_is_replaced(spec):
    s = ServerProcess(spec).start()
    try:
        assert s.wait_ready(CEILING_S)
        (server, worker), = pids_of(spec)
        os.kill(server, signal.SIGSTOP)  # alive but silent (a hung engine)
        assert wait_until(lambda: s.restarts == 1 and s.state == "ready")
        assert s.last_error == "engine stopped answering /health"
        assert wait_until(lambda: not alive(server) and not alive(worker))
    finally:
        s.stop()


def test_a_server_that_cannot_start_ends_failed_with_the_reason(spec):
    spec.args = ["--exit-at-once"]
    s = ServerProcess(spec).start()
    assert not s.wait_ready(CEILING_S)
    assert s.state == "failed" and s.restarts == 1
    assert "exited with code 3" in s.last_error and "gave up after 2 failed starts" in s.last_error
    s.stop()


def test_missing_interpreter_is_a_clear_error(spec):
    spec.python = "/nonexistent/python"
    with pytest.raises(FileNotFoundError, match="make install"):
        ServerProcess(spec).start()


def start_supervisor_process(spec, tmp_path, block_signals: bool = False) -> tuple[subprocess.Popen, int]:
    """Run a ServerProcess in a child Python process (the replica's place); returns that process and the guard's
    process-group id once the stand-in server is ready. Its log goes to tmp_path (it is killed, not stopped).
    ``block_signals``: SIGINT and SIGTERM blocked in the supervising threads, as in a Ray Serve replica (where a
    guard inherited that mask and never saw its parent-death SIGTERM: found orphaned with it pending)."""
    fields = dict(spec.__dict__, log_path=str(tmp_path / "engine.log"))
    code = textwrap.dedent(f'''
        import signal, sys, time
        from services.engines.process import ServerProcess, ServerSpec
        if {block_signals!r}:
            signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGINT, signal.SIGTERM}})
        s = ServerProcess(ServerSpec(**{fields!r})).start()
        print("ready" if s.wait_ready({CEILING_S}) else "failed", s.pid, flush=True)
        time.sleep(600)
    ''')
    sup = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    line = sup.stdout.readline().split()
    assert line[0] == "ready"
    return sup, int(line[1])


@pytest.mark.parametrize("block_signals", [False, True], ids=["plain", "signals-blocked-as-in-ray"])
def test_never_orphaned_when_the_supervising_process_is_killed(spec, tmp_path, block_signals):
    sup, pgid = start_supervisor_process(spec, tmp_path, block_signals)
    (server, worker), = pids_of(spec)
    assert set(group_members(pgid)) == {pgid, server, worker}
    sup.kill()  # SIGKILL: no atexit, no finally; only the kernel's parent-death signal is left
    sup.wait()
    assert wait_until(lambda: not group_members(pgid)), group_members(pgid)


def test_client_reads_vllm_logprobs_by_token_id_most_likely_first():
    from core.llm_client import TokenLogprob
    from core.vllm_client import parse_logprobs

    lp = {"tokens": ["token_id:5", "token_id:9"], "token_logprobs": [-0.1, -3.0],
          "top_logprobs": [{"token_id:5": -0.1, "token_id:7": -2.0, "token_id:3": -0.5},
                           # the sampled token comes first in vLLM's dict, even when it is not in the top k
                           {"token_id:9": -3.0, "token_id:1": -0.2, "token_id:2": -0.4}]}
    assert parse_logprobs(lp, 2) == [TokenLogprob(5, -0.1, [(5, -0.1), (3, -0.5)]),
                                     TokenLogprob(9, -3.0, [(1, -0.2), (2, -0.4)])]
    assert parse_logprobs(lp, 0)[1] == TokenLogprob(9, -3.0, [])
    assert parse_logprobs(None, 5) is None


def test_completion_request_body():
    import torch

    from core.llm_client import CompletionRequest
    from core.vllm_client import request_body

    body = request_body(CompletionRequest(prompt=[1, 2], max_tokens=3), model="m")
    assert body["prompt"] == [1, 2] and "prompt_embeds" not in body and "seed" not in body
    assert body["model"] == "m" and body["stream"] and body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert body["stream_options"] == {"include_usage": True} and "logit_bias" not in body
    body = request_body(CompletionRequest(prompt=torch.zeros(3, 4), max_tokens=3, seed=-1, banned_tokens={7: "<x>"},
                                          extra_args={"x": [1]}))
    assert "prompt" not in body and body["prompt_embeds"] and body["seed"] == 2**63 - 1
    assert body["bad_words"] == ["<x>"] and "logit_bias" not in body and body["vllm_xargs"] == {"x": [1]}
    with pytest.raises(ValueError, match="token ids or a"):
        request_body(CompletionRequest(prompt=torch.zeros(3), max_tokens=3))


def test_mixed_prompt_body_and_chat_stream(model_dir):
    """An embeddings prompt with ``prompt_token_ids`` and the LLM's tokenizer -> vLLM's mixed prompt on the chat
    endpoint: a ``text`` part per run of ids that the tokenizer encodes back exactly, the image rows and any run
    that does not (here ``a`` ``b`` as two ids, which re-encodes as one) as ``prompt_embeds`` parts (adjacent
    ones merged), chat logprobs asked as ``logprobs`` + ``top_logprobs``; without the tokenizer, or without ids,
    the embeddings-only completions body. The chat stream: the first chunk (role only) gives no chunk, its
    ``prompt_token_ids`` are checked at the text positions (EngineError on a difference), content chunks and
    their logprobs parse like the completions stream's."""
    import base64
    import io
    import json

    import torch

    from core.llm_client import CompletionRequest, EngineError, TokenLogprob
    from core.smollm2 import smollm2_tokenizer
    from core.vllm_client import _chunks, request_body

    tok = smollm2_tokenizer(model_dir)
    a = tok.encode("<|im_start|>user\n", add_special_tokens=False)
    b = tok.convert_tokens_to_ids(["a", "b"])
    assert tok.encode("ab", add_special_tokens=False) != b  # not what the tokenizer makes of its text
    c = tok.encode(" What is it?<|im_end|>\n", add_special_tokens=False)
    ids = a + [None] * 3 + b + [None] * 2 + c
    embeds = torch.arange(len(ids) * 4, dtype=torch.float32).reshape(len(ids), 4)
    req = CompletionRequest(prompt=embeds, max_tokens=3, prompt_token_ids=ids, logprobs=2,
                            banned_tokens={13: "<jupyter_code>"})
    body = request_body(req, model="m", tokenizer=tok)
    parts = body["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text", "prompt_embeds", "text"] and "prompt_embeds" not in body
    assert parts[0]["text"] == "<|im_start|>user\n" and parts[2]["text"] == " What is it?<|im_end|>\n"
    rows = torch.load(io.BytesIO(base64.b64decode(parts[1]["data"])))
    assert torch.equal(rows, embeds[len(a):len(a) + 7])
    assert body["_expected_prompt_ids"] == a + [None] * 7 + c
    assert body["logprobs"] is True and body["top_logprobs"] == 2 and body["bad_words"] == ["<jupyter_code>"]
    for plain in (request_body(req, model="m"), request_body(CompletionRequest(prompt=embeds, max_tokens=3),
                                                             tokenizer=tok)):
        assert "messages" not in plain and plain["prompt_embeds"]
    with pytest.raises(ValueError, match="entries for"):
        request_body(CompletionRequest(prompt=embeds, max_tokens=3, prompt_token_ids=ids[1:]), tokenizer=tok)

    expected = body["_expected_prompt_ids"]
    got = [x if x is not None else 49152 for x in expected]
    first = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "prompt_token_ids": got}
    assert _chunks(json.dumps(first), 2, expected) == []
    with pytest.raises(EngineError, match="first difference at 1"):
        _chunks(json.dumps(first | {"prompt_token_ids": [got[0], 0] + got[2:]}), 2, expected)
    with pytest.raises(EngineError, match="ids for"):
        _chunks(json.dumps(first | {"prompt_token_ids": got[:-1]}), 2, expected)
    lp = {"content": [{"token": "token_id:5", "logprob": -0.1, "top_logprobs": [
        {"token": "token_id:3", "logprob": -0.5}, {"token": "token_id:5", "logprob": -0.1}]}]}
    chunk = {"choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [5], "logprobs": lp,
                          "finish_reason": "length"}]}
    (out,) = _chunks(json.dumps(chunk), 2, expected)
    assert (out.text, out.token_ids, out.finish_reason) == ("Hi", [5], "length")
    assert out.logprobs == [TokenLogprob(5, -0.1, [(5, -0.1), (3, -0.5)])]


def test_never_orphaned_when_supervisor_and_guard_are_killed_together(spec, tmp_path):
    """Ray SIGKILLs a dying replica's children, the guard among them: the server dies with the guard
    (PR_SET_PDEATHSIG) and the server's own worker follows its dead parent (services/engines/engine_site/sitecustomize.py)."""
    sup, pgid = start_supervisor_process(spec, tmp_path)
    (server, worker), = pids_of(spec)
    os.kill(pgid, signal.SIGKILL)  # the guard (the group leader), with no chance to sweep
    sup.kill()
    sup.wait()
    assert wait_until(lambda: not alive(server) and not alive(worker)), group_members(pgid)


def test_a_process_whose_parent_died_before_it_started_follows_it(tmp_path):
    """The race of the parent-death watch (engine_site/sitecustomize.py): a Python process of the engine's group
    spawns a child and dies before the child's interpreter has started; the child, already re-parented, must
    not take its new parent for its own. The child's ``sh`` waits until the spawner has been reaped, then execs
    Python, whose start-up must SIGKILL it (before the fix it slept its 600 s, an orphan)."""
    from services.engines.process import ENGINE_SITE

    pid_file = tmp_path / "child.pid"
    spawner = textwrap.dedent(f'''
        import os, subprocess, sys
        child = subprocess.Popen(["sh", "-c", "while kill -0 $SPAWNER 2>/dev/null; do sleep 0.05; done; "
                                  "exec {sys.executable} -c 'import time; time.sleep(600)'"],
                                 env=dict(os.environ, SPAWNER=str(os.getpid())))
        open({str(pid_file)!r}, "w").write(str(child.pid))
        os._exit(0)
    ''')
    env = dict(os.environ, PYTHONPATH=ENGINE_SITE, CHIMERA_ENGINE_DIE_WITH_PARENT="1")
    env.pop("CHIMERA_ENGINE_PARENT_PID", None)
    subprocess.run([sys.executable, "-c", spawner], env=env, check=True, timeout=CEILING_S)  # reaped: gone
    child = int(pid_file.read_text())
    try:
        assert wait_until(lambda: not alive(child)), "the orphaned child outlived its dead parent"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_taken_port_costs_one_failed_start_then_another_port_serves(spec):
    import socket

    s = ServerProcess(spec)
    taken = s.port
    with socket.socket() as blocker:  # someone else binds the chosen port before the server does
        blocker.bind(("127.0.0.1", taken))
        blocker.listen()
        s.start()
        try:
            assert s.wait_ready(CEILING_S)
            assert s.restarts == 1 and s.port != taken and s.base_url == f"http://127.0.0.1:{s.port}"
            assert "exited with code 1" in s.last_error
            assert httpx.get(f"{s.base_url}/health").status_code == 200
        finally:
            s.stop()


def test_free_ports_stay_out_of_the_ephemeral_range_and_ray_worker_ports(monkeypatch):
    """Stop 39's CI: the service's HTTP port, picked by ``bind(0)`` from the kernel's ephemeral range, was taken by
    one of Ray's outgoing connections before the proxy bound it. Ports now come from the gap between Ray's worker
    ports and that range, are free (a bind succeeds), and a range too small for the gap falls back to the OS's
    pick."""
    import socket

    from services.engines import process

    ephemeral = process._ephemeral_ports()
    ports = {process.free_port() for _ in range(50)}
    assert all(process.RAY_WORKER_PORTS.stop <= p < ephemeral.start for p in ports), sorted(ports)
    assert len(ports) > 40  # at random over some 12,000 ports, not one port again and again
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports.pop()))
    monkeypatch.setattr(process, "_ephemeral_ports", lambda: range(20500, 61000))  # a gap of 500 ports
    assert process.free_port() in ephemeral  # the OS's pick, from its own ephemeral range


def test_a_stop_during_a_spawn_kills_what_the_spawn_started(spec, monkeypatch):
    """Issue 24 item 11: ``stop()`` called while the supervisor thread is inside ``Popen`` (the process exists but
    is not yet in ``_proc``) must still end it; before, stop() found no process to kill, the spawn then stored it and
    the supervisor left: the server ran on unsupervised until the guard's parent-death signal (the supervisor
    thread's exit) caught up with it, after stop() had returned. The interleaving is forced with events."""
    import threading

    import services.engines.process as ep

    in_spawn, release, spawned = threading.Event(), threading.Event(), []
    real_popen = subprocess.Popen

    def held_popen(*args, **kwargs):  # the real Popen, then held until stop() has been called
        p = real_popen(*args, **kwargs)
        spawned.append(p)
        in_spawn.set()
        assert release.wait(CEILING_S)
        return p

    monkeypatch.setattr(ep.subprocess, "Popen", held_popen)
    s = ServerProcess(spec).start()
    assert in_spawn.wait(CEILING_S)
    stopper = threading.Thread(target=s.stop)
    stopper.start()
    assert s._stop.wait(CEILING_S)  # stop() has begun
    release.set()
    stopper.join(CEILING_S)
    assert not stopper.is_alive() and s.state == "stopped" and s.pid is None
    (guard,) = spawned
    assert guard.poll() is not None  # stop() itself ended what the spawn started, before returning
    assert wait_until(lambda: not group_members(guard.pid))
    assert not any(alive(p) for pair in pids_of(spec) for p in pair)
