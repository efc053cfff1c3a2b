"""The ground layer (``core/``): one seed range for every family, one image decoder and data-URL parser with one
error-code set, one path resolver, the InputError base pickling intact, and core importing no family."""

from __future__ import annotations

import base64
import io
import pickle

import pytest
from PIL import Image


def _png(size=(4, 4)) -> bytes:
    buf = io.BytesIO()
    Image.effect_noise(size, 64).convert("RGB").save(buf, format="PNG")  # noise: the pixel data is not tiny
    return buf.getvalue()


def test_one_seed_range_for_chat_speech_and_video(profile):
    from audio.validate import SpeechInputError
    from core.validate import InputError, check_seed
    from grafting.processor import PromptError
    from video.request import RequestError, plan_request

    for ok in (None, 0, 7, -(2**63 - 1), 2**63 - 1):
        assert check_seed(ok) == ok
    for error in (InputError, PromptError, SpeechInputError, RequestError):
        for bad in (2**63, -2**63, True, 1.5, "3"):
            with pytest.raises(error) as info:
                check_seed(bad, error)
            assert (info.value.status_code, info.value.param, info.value.code) == (400, "seed", "invalid_value")
    cfg = profile.video.engine
    assert plan_request(cfg, {"prompt": "a", "seed": -5}).seed == -5  # video takes chat's and speech's range now
    with pytest.raises(RequestError) as info:
        plan_request(cfg, {"prompt": "a", "seed": 2**63})
    assert (info.value.param, info.value.code) == ("seed", "invalid_value")
    assert plan_request(cfg, {"prompt": "a", "seed": "12"}).seed == 12  # a form's text, as before


def test_one_image_decoder_and_data_url_parser():
    from core.media import ImageInputError, decode_image, parse_data_url

    assert decode_image(_png(), 100).size == (4, 4)
    bmp = io.BytesIO()
    Image.new("RGB", (4, 4)).save(bmp, format="BMP")
    cases = [(lambda: decode_image(bmp.getvalue(), 100, "p"), 415, "unsupported_image_type"),  # not allow-listed
             (lambda: decode_image(b"nope", 100, "p"), 415, "unsupported_image_type"),
             (lambda: decode_image(_png((8, 8))[:120], 100, "p"), 400, "invalid_image"),        # truncated
             (lambda: decode_image(_png((20, 20)), 100, "p"), 413, "image_too_large"),         # pixels
             (lambda: decode_image(_png(), 100, "p", max_bytes=10), 413, "image_too_large"),   # bytes
             (lambda: parse_data_url("http://x/a.png", param="p"), 400, "invalid_image_url"),
             (lambda: parse_data_url("data:image/png,abc", param="p"), 400, "invalid_image_url"),  # not base64
             (lambda: parse_data_url("data:image/png;base64,@@", param="p"), 400, "invalid_base64"),
             (lambda: parse_data_url("data:text/plain;base64,aGk=", param="p"), 415, "unsupported_image_type"),
             (lambda: parse_data_url("data:image/png;base64," + "A" * 400, 100, "p"), 413, "image_too_large")]
    for call, status, code in cases:
        with pytest.raises(ImageInputError) as info:
            call()
        assert (info.value.status_code, info.value.code, info.value.param) == (status, code, "p")
        back = pickle.loads(pickle.dumps(info.value))
        assert (type(back), str(back), back.status_code, back.code, back.param) == \
            (ImageInputError, str(info.value), status, code, "p")
    assert parse_data_url("data:image/png;base64," + base64.b64encode(b"abc").decode()) == b"abc"
    assert parse_data_url("data:;base64,YQ==") == b"a"  # no media type: judged by the decoder


def test_family_errors_share_the_input_error_base_and_pickle_intact():
    from audio.validate import SpeechInputError
    from core.validate import InputError
    from grafting.processor import PromptError
    from video.media import MediaError
    from video.request import RequestError

    for err, want in [(PromptError("m"), (400, "messages", "invalid_messages")),
                      (SpeechInputError("m", "voice", "unknown_voice"), (400, "voice", "unknown_voice")),
                      (RequestError("m", "size", "invalid_size"), (400, "size", "invalid_size")),
                      (MediaError("m", 413, "video"), (413, "video", "too_large"))]:
        assert isinstance(err, InputError) and isinstance(err, ValueError)
        for e in (err, pickle.loads(pickle.dumps(err))):
            assert (type(e), str(e), (e.status_code, e.param, e.code)) == (type(err), "m", want)


def test_one_path_resolver(tmp_path):
    from core.config import resolve_path

    (tmp_path / "here").mkdir()
    assert resolve_path(tmp_path, "here") == str(tmp_path / "here")
    assert resolve_path(tmp_path, "org/name") == "org/name"                         # a hub id
    assert resolve_path(tmp_path, "org/name", local=True) == str(tmp_path / "org/name")  # to be built there
    assert resolve_path(tmp_path, "/abs/dir", local=True) == "/abs/dir"
    assert resolve_path(tmp_path, "s3://bucket/x", local=True) == "s3://bucket/x"
    assert resolve_path(None, "here") == "here"


def test_core_imports_no_family():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "core"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for name in names:
                assert name.split(".")[0] not in ("grafting", "video", "audio", "services"), (path.name, name)
