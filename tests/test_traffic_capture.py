"""The VLM's traffic dataset (grafting/traffic.py): off by default and validated at profile load; the writer's
line format (text kept, images by reference), each image's embeddings stored once beside it (float16, 0600), its
size cap over lines and embeddings (the line that would pass it and all later ones not written, one warning,
counters and the /metrics series); the reader's text and image conversations, its counted skips of lines whose
embeddings are missing, its refusals naming the line; ``chimera speculator train --traffic``'s refusal of a bad
file before any work. Capture through the real deployment, a head trained on it and served:
tests/test_traffic_head_vllm.py."""

from __future__ import annotations

import json
import logging

import pytest

import torch
from safetensors.torch import load_file

from grafting.traffic import TrafficWriter, embeds_bytes, embeds_file, read_traffic, traffic_line

PNG = "data:image/png;base64,iVBORw0KGgo="
KEY = "0123456789abcdef0123456789abcdef"
KEY2 = "fedcba9876543210fedcba9876543210"


def _chat(text: str, image: bool = False) -> list[dict]:
    content = [{"type": "image_url", "image_url": {"url": PNG}}, {"type": "text", "text": text}] if image else text
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]


def test_capture_is_off_by_default_and_its_keys_are_checked_at_profile_load():
    from pydantic import ValidationError

    from grafting.config import VLMConfig
    from services.config.profiles import load_profile

    assert VLMConfig().traffic_capture.enabled is False
    for name in ("cpu", "gpu"):
        assert load_profile(name).vlm.engine.traffic_capture.enabled is False
    assert VLMConfig(traffic_capture={"enabled": True, "max_mb": 0.5}).traffic_capture.max_mb == 0.5
    with pytest.raises(ValidationError, match="max_mb"):
        VLMConfig(traffic_capture={"enabled": True, "max_mb": 0})
    with pytest.raises(ValidationError, match="max_bytes"):
        VLMConfig(traffic_capture={"enabled": True, "max_bytes": 10})


def test_a_line_keeps_the_text_and_replaces_each_image_by_its_key():
    line = traffic_line(_chat("What is this?", image=True), [KEY])
    assert line == {"v": 1, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image_ref", "key": KEY}, {"type": "text", "text": "What is this?"}]}]}
    assert PNG not in json.dumps(line)
    with pytest.raises(ValueError, match="image keys"):
        traffic_line(_chat("x", image=True), [])
    with pytest.raises(ValueError, match="image keys"):
        traffic_line(_chat("x"), [KEY])


def test_the_writer_stops_at_its_cap_and_says_so(tmp_path, caplog):
    from prometheus_client import generate_latest

    from services.api import metrics

    path = tmp_path / "sub" / "traffic.jsonl"
    one = len(json.dumps(traffic_line(_chat("Hello there"), []), ensure_ascii=False)) + 1
    w = TrafficWriter(path, max_bytes=2 * one + 10)
    with caplog.at_level(logging.WARNING, logger="chimera"):
        assert w.record(_chat("Hello there"), []) and w.record(_chat("Hello there"), [])
        assert not w.record(_chat("Hello there"), []) and not w.record(_chat("Hi"), [])
    assert path.stat().st_size == 2 * one and (path.stat().st_mode & 0o777) == 0o600
    assert w.stats() == {"written": 2, "dropped": 2, "full": True}
    assert sum("reached its cap" in r.getMessage() for r in caplog.records) == 1
    assert [json.loads(x)["messages"][1]["content"] for x in path.read_text().splitlines()] == ["Hello there"] * 2
    again = TrafficWriter(path, max_bytes=2 * one)  # a new writer (replica restart) on a full file: full at once
    assert again.full and not again.record(_chat("x"), [])
    other = TrafficWriter(path, max_bytes=3 * one)  # another replica on the same file: the file's size counts
    assert other.record(_chat("Hello there"), []) and not w.record(_chat("Hello there"), [])
    path.unlink()  # deleting the file starts again
    with caplog.at_level(logging.WARNING, logger="chimera"):
        assert w.record(_chat("Hello there"), []) and not w.full and w.record(_chat("Hello there"), [])
        assert not w.record(_chat("Hello there"), [])
    assert sum("reached its cap" in r.getMessage() for r in caplog.records) == 3  # w twice, again once
    assert w.stats() == {"written": 4, "dropped": 4, "full": True}
    metrics.observe_vlm_end_event("test-traffic", {"traffic_capture": {"replica": "r", "stats": w.stats()}})
    text = generate_latest(metrics.REGISTRY).decode()
    assert 'chimera_vlm_traffic_capture_prompts_total{model="test-traffic",outcome="dropped",replica="r"} 4.0' in text
    assert 'chimera_vlm_traffic_capture_full{model="test-traffic",replica="r"} 1.0' in text


def _feats(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))


def test_the_writer_stores_each_images_embeddings_once_and_counts_them_in_the_cap(tmp_path, caplog):
    path = tmp_path / "traffic.jsonl"
    line = len(json.dumps(traffic_line(_chat("What is this?", image=True), [KEY]), ensure_ascii=False)) + 1
    blob = len(embeds_bytes(_feats(16, 0)))
    assert blob > 16 * 8 * 2  # float16 rows and the safetensors header
    w = TrafficWriter(path, max_bytes=3 * line + 2 * blob - 1)  # room for 3 lines and 2 images, less one byte
    assert w.record(_chat("What is this?", image=True), [KEY], {KEY: _feats(16, 0)})
    f = embeds_file(path, KEY)
    assert f == tmp_path / "traffic.embeds" / f"{KEY}.safetensors" and f.stat().st_size == blob
    assert (f.stat().st_mode & 0o777) == 0o600 and (f.parent.stat().st_mode & 0o777) == 0o700
    stored = load_file(str(f))["embeds"]
    assert stored.dtype == torch.float16 and torch.equal(stored, _feats(16, 0).half())
    assert w.missing([KEY, KEY2]) == {KEY2}
    # the same image again: the stored file is used (no features needed), never rewritten
    mtime = f.stat().st_mtime_ns
    assert w.record(_chat("What is this?", image=True), [KEY])
    assert f.stat().st_mtime_ns == mtime and w.size() == 2 * line + blob
    # a new image whose embeddings would pass the cap: neither they nor the line are written
    with caplog.at_level(logging.WARNING, logger="chimera"):
        assert not w.record(_chat("What is this?", image=True), [KEY2], {KEY2: _feats(16, 1)})
    assert not embeds_file(path, KEY2).exists() and w.size() == 2 * line + blob
    assert w.stats() == {"written": 2, "dropped": 1, "full": True}
    assert sum("reached its cap" in r.getMessage() for r in caplog.records) == 1
    assert w.record(_chat("What is this?", image=True), [KEY])  # a line alone still fits
    bigger = TrafficWriter(path, max_bytes=4 * line + 2 * blob)  # exactly one more line and image
    assert bigger.record(_chat("What is this?", image=True), [KEY2], {KEY2: _feats(16, 1)})
    assert bigger.size() == 4 * line + 2 * blob
    with pytest.raises(ValueError, match="no embeddings for image"):
        w.record(_chat("x", image=True), ["f" * 32])
    with pytest.raises(ValueError, match="32 lower-case hex"):
        w.record(_chat("x", image=True), ["../../" + "0" * 26], {"../../" + "0" * 26: _feats(2, 0)})
    with pytest.raises(ValueError, match="shape"):
        w.record(_chat("x", image=True), ["e" * 32], {"e" * 32: torch.zeros(3)})
    assert not embeds_file(path, "e" * 32).exists()


def test_the_reader_returns_conversations_with_their_embeddings_and_counts_missing_ones(tmp_path):
    path = tmp_path / "t.jsonl"
    w = TrafficWriter(path, max_bytes=1 << 20)
    w.record(_chat("One"), [])
    w.record(_chat("Two", image=True), [KEY], {KEY: _feats(16, 0)})
    w.record(_chat("Three"), [])
    w.record(_chat("Four", image=True), [KEY2], {KEY2: _feats(4, 1)})
    w.record(_chat("Five", image=True), [KEY])
    embeds_file(path, KEY2).unlink()  # deleted since: that line is skipped and counted
    t = read_traffic(path)
    assert [c[1]["content"] for c in t.text] == ["One", "Three"] and t.missing == 1
    assert [m[1]["content"][1]["text"] for m, _ in t.images] == ["Two", "Five"]
    assert all(len(e) == 1 and torch.equal(e[0], _feats(16, 0).half()) for _, e in t.images)
    good = json.dumps({"v": 1, "messages": _chat("ok")})
    ref = {"role": "user", "content": [{"type": "image_ref", "key": KEY}]}
    for bad, why in (("{not json", "not JSON"), ('{"v": 2, "messages": []}', "not a traffic line"),
                     ('{"v": 1}', "not a traffic line"), ('{"v": 1, "messages": []}', "not a traffic line"),
                     (json.dumps({"v": 1, "messages": [{"role": "user"}]}), "not a traffic line"),
                     (json.dumps({"v": 1, "messages": [dict(ref, name="x")]}), "not a traffic line"),
                     (json.dumps({"v": 1, "messages": [{"role": "user", "content": [
                         {"type": "image_ref", "key": "../" + KEY}]}]}), "not a traffic line"),
                     (json.dumps({"v": 1, "messages": [{"role": "user", "content": [
                         {"type": "image_url", "image_url": {"url": PNG}}]}]}), "not a traffic line")):
        (tmp_path / "bad.jsonl").write_text(good + "\n" + bad + "\n")
        with pytest.raises(ValueError, match=f"bad.jsonl:2: {why}"):
            read_traffic(tmp_path / "bad.jsonl")
    embeds_file(path, KEY).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=f"t.jsonl:2: image {KEY}: .*unreadable"):
        read_traffic(path)
    from safetensors.torch import save_file

    save_file({"embeds": torch.zeros(4, 8)}, str(embeds_file(path, KEY)))  # float32: not what the writer stores
    with pytest.raises(ValueError, match="t.jsonl:2: .*float16"):
        read_traffic(path)


def test_speculator_train_refuses_a_bad_traffic_file_before_any_work(tmp_path):
    from typer.testing import CliRunner

    from services.cli import app

    (tmp_path / "bad.jsonl").write_text("{not json\n")
    for arg, why in ((tmp_path / "bad.jsonl", "not JSON"), (tmp_path / "missing.jsonl", "No such file")):
        r = CliRunner().invoke(app, ["speculator", "train", "--traffic", str(arg), "--out", str(tmp_path / "h")])
        assert r.exit_code == 2 and why in r.output, r.output
    for n in ("0", "25"):  # the held-out chat prompts are the first of the evaluation's 24
        r = CliRunner().invoke(app, ["speculator", "train", "--heldout-chat", n, "--out", str(tmp_path / "h")])
        assert r.exit_code == 2 and "--heldout-chat" in r.output, r.output
