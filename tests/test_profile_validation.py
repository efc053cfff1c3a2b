"""A profile whose defaults its own request checks would refuse is refused when it loads, naming the key.

Otherwise it loads, and every request that leaves the field out gets a 400 about a field the client never sent
(e.g. ``default_max_new_tokens`` over ``max_new_tokens``: each chat request without ``max_tokens`` answered
"max_tokens must be an integer from 1 to ..."). Each case edits one key of the shipped cpu profile (gpu where the
key only exists there) and expects :class:`services.config.profiles.ProfileError` naming the full dotted key.
"""

from __future__ import annotations

import copy

import pytest
import yaml

from services.config.profiles import CONFIG_DIR, ProfileError, load_profile, parse_profile

CPU = yaml.safe_load((CONFIG_DIR / "cpu.yaml").read_text())
GPU = yaml.safe_load((CONFIG_DIR / "gpu.yaml").read_text())

# (profile, {dotted key: value} edits, the dotted key the error must name)
BAD = [
    (CPU, {"vlm.engine.default_max_new_tokens": 513, "vlm.engine.max_new_tokens": 512},
     "vlm.engine.default_max_new_tokens"),
    (CPU, {"video.engine.defaults.frames_per_clip": 8}, "video.engine.defaults.frames_per_clip"),
    (CPU, {"video.engine.defaults.frames_per_clip": 1}, "video.engine.defaults.frames_per_clip"),
    (CPU, {"video.engine.defaults.frames_per_clip": 37}, "video.engine.defaults.frames_per_clip"),  # limit 33
    (CPU, {"video.engine.defaults.width": 72}, "video.engine.defaults.width"),  # ti2v: multiples of 32
    (CPU, {"video.engine.defaults.height": 40}, "video.engine.defaults.height"),
    (CPU, {"video.engine.defaults.width": 288}, "video.engine.defaults.width"),  # over max_width 256
    (CPU, {"video.engine.defaults.height": 288}, "video.engine.defaults.height"),
    (GPU, {"video.engine.defaults.width": 1280, "video.engine.defaults.height": 1280},
     "video.engine.defaults.width"),  # over max_pixels 921600
    (CPU, {"video.engine.defaults.num_inference_steps": 51}, "video.engine.defaults.num_inference_steps"),
    (CPU, {"video.engine.defaults.guidance_scale": 51.0}, "video.engine.defaults.guidance_scale"),
    (CPU, {"video.engine.defaults.negative_prompt": "x" * 2001}, "video.engine.defaults.negative_prompt"),
    (GPU, {"video.engine.fast.num_inference_steps": 101}, "video.engine.fast.num_inference_steps"),
    (GPU, {"video.engine.fast.guidance_scale": 60.0}, "video.engine.fast.guidance_scale"),
    (CPU, {"tts.engine.default_voice": "alloy"}, "tts.engine.default_voice"),
    (CPU, {"tts.engine.voices": ["Tara", "leo"], "tts.engine.default_voice": "leo"}, "tts.engine.voices"),
    (CPU, {"tts.engine.min_speed": 1.5}, "tts.engine.min_speed"),
    (CPU, {"tts.engine.max_speed": 0.5}, "tts.engine.max_speed"),
    (CPU, {"tts.engine.seed": 2**63}, "tts.engine.seed"),
    (CPU, {"tts.engine.min_frames": 65}, "tts.engine.min_frames"),  # max_frames 64
]


def edited(profile: dict, edits: dict) -> dict:
    """A deep copy of ``profile`` with each ``a.b.c: value`` of ``edits`` set."""
    data = copy.deepcopy(profile)
    for key, value in edits.items():
        *path, last = key.split(".")
        node = data
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    return data


def test_the_shipped_profiles_pass():
    for name in ("cpu", "gpu"):
        load_profile(name)


@pytest.mark.parametrize("profile,edits,key", BAD, ids=[f"{k}={list(e.values())[0]!r:.20}" for _, e, k in BAD])
def test_a_default_its_own_checks_refuse_is_refused_at_load_naming_the_key(profile, edits, key):
    with pytest.raises(ProfileError) as info:
        parse_profile(edited(profile, edits))
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid profile:" and lines[1].startswith(f"  {key}: "), str(info.value)


@pytest.mark.parametrize("edits", [
    {"vlm.engine.default_max_new_tokens": 512, "vlm.engine.max_new_tokens": 512},  # at the limit: allowed
    {"video.engine.defaults.frames_per_clip": 5},
    {"video.engine.defaults.frames_per_clip": 33},
    {"video.engine.defaults.width": 256, "video.engine.defaults.height": 256},
    {"tts.engine.min_speed": 1.0, "tts.engine.max_speed": 1.0},
    {"tts.engine.seed": 2**63 - 1},
], ids=str)
def test_defaults_at_their_limits_load(edits):
    parse_profile(edited(CPU, edits))


def test_the_deployment_refuses_it_too():
    """A replica validates its section again (``FamilySection.model_validate``): the same check, the same key."""
    from pydantic import ValidationError

    from core.config import ConfigFieldError
    from grafting.config import VLMConfig
    from services.config.profiles import FamilySection

    section = edited(CPU, {"vlm.engine.default_max_new_tokens": 4096})["vlm"]
    with pytest.raises(ValidationError) as info:
        FamilySection[VLMConfig].model_validate(section)
    cause = info.value.errors()[0]["ctx"]["error"]
    assert isinstance(cause, ConfigFieldError) and cause.field == "default_max_new_tokens"
