"""Image-embedding cache (grafting/image_cache.py): exact hits, content keys, the byte bound, LRU order."""

from __future__ import annotations

import base64
import io

import pytest
import torch
from PIL import Image

from grafting.engine import VLMEngine
from grafting.image_cache import ImageFeatureCache, image_keys, tensor_bytes
from tests.conftest import data_url


@pytest.fixture(scope="module")
def engine(profile, model_dir) -> VLMEngine:
    eng = VLMEngine.from_config(profile.vlm.engine, model_dir)
    eng.model.image_cache = None
    return eng


@pytest.fixture
def tower_calls(engine):
    """Counts forward calls of the real tower (a forward hook; the tower itself runs unchanged)."""
    calls = []
    handle = engine.model.tower.register_forward_hook(lambda *a: calls.append(1))
    yield calls
    handle.remove()


def _url(img: Image.Image, fmt: str, **save) -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **save)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _msgs(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": "Describe."}]}]


def _features(engine, prompt):
    with torch.inference_mode():
        return engine.model.image_features(prompt.pixel_values, prompt.image_grid_thw)


def test_hit_equals_fresh_computation_and_skips_the_tower(engine, astronaut, tower_calls):
    p = engine.prepare(_msgs(data_url(astronaut)))
    fresh = _features(engine, p)  # no cache attached: the reference path
    assert len(tower_calls) == 1
    engine.model.image_cache = cache = ImageFeatureCache(64 * 1024 * 1024)
    try:
        miss = _features(engine, p)
        hit = _features(engine, p)
    finally:
        engine.model.image_cache = None
    assert len(tower_calls) == 2  # the miss ran the tower, the hit did not
    assert torch.equal(miss, fresh) and torch.equal(hit, fresh)  # exact, bit for bit
    assert hit.dtype == fresh.dtype and hit.device == fresh.device
    s = cache.stats()
    assert (s.hits, s.misses, s.entries, s.evictions) == (1, 1, 1, 0)
    assert s.bytes == tensor_bytes(fresh) == 64 * 576 * 4  # 64 LLM tokens x hidden 576 x fp32


def test_features_by_key_for_traffic_capture_are_the_served_rows_and_count_no_lookup(engine, astronaut,
                                                                                      tower_calls):
    """What traffic capture stores per image (``GraftedVLM.features_by_key``): the image's own rows, bit for bit
    what it was served with; from the cache without counting a hit or a miss (``peek``), else one tower run."""
    small = astronaut.crop((0, 0, 256, 256))
    p = engine.prepare(_msgs(data_url(astronaut), data_url(small)))
    keys = image_keys(p.pixel_values, p.image_grid_thw)
    alone = [_features(engine, engine.prepare(_msgs(data_url(img)))) for img in (astronaut, small)]
    calls = len(tower_calls)
    assert engine.model.features_by_key(p.pixel_values, p.image_grid_thw, set()) == {}
    got = engine.model.features_by_key(p.pixel_values, p.image_grid_thw, {keys[1]})
    assert list(got) == [keys[1]] and torch.equal(got[keys[1]], alone[1]) and len(tower_calls) == calls + 1
    engine.model.image_cache = cache = ImageFeatureCache(64 * 1024 * 1024)
    try:
        _features(engine, p)  # served: two misses, stored
        got = engine.model.features_by_key(p.pixel_values, p.image_grid_thw, set(keys))
    finally:
        engine.model.image_cache = None
    assert len(tower_calls) == calls + 3  # the serve's two encodes; features_by_key read the cache
    assert [torch.equal(got[k], a) for k, a in zip(keys, alone)] == [True, True]
    assert (cache.stats().hits, cache.stats().misses) == (0, 2)


def test_a_captured_conversation_is_rebuilt_into_the_served_ids_and_embeddings(engine, astronaut):
    """``GraftProcessor.ids_with_image_rows`` + ``GraftedVLM.embed_features`` (how ``--traffic`` rebuilds a captured
    image chat from its stored rows) give the ids and the embeddings ``prepare`` + ``embed`` served."""
    from grafting.processor import PromptError

    wide = astronaut.crop((0, 0, 512, 256))
    msgs = [{"role": "system", "content": "Be brief."}] + _msgs(data_url(astronaut), data_url(wide))
    p = engine.prepare(msgs)
    keys = image_keys(p.pixel_values, p.image_grid_thw)
    feats = engine.model.features_by_key(p.pixel_values, p.image_grid_thw, set(keys))
    refs = [msgs[0], {"role": "user", "content": [{"type": "image_ref", "key": k} for k in keys]
                      + [{"type": "text", "text": "Describe."}]}]
    rows = [feats[k].shape[0] for k in keys]
    assert rows == [64, 32]
    ids = engine.processor.ids_with_image_rows(refs, rows)
    assert torch.equal(ids, p.input_ids)
    with torch.inference_mode():
        rebuilt = engine.model.embed_features(ids, torch.cat([feats[k] for k in keys]))
        served = engine.model.embed(p.input_ids, p.pixel_values, p.image_grid_thw)
    assert torch.allclose(rebuilt, served, atol=1e-5)  # packed vs alone encodes: equal up to the last bits
    with pytest.raises(PromptError, match="2 image references but 1"):
        engine.processor.ids_with_image_rows(refs, rows[:1])
    with pytest.raises(ValueError, match="the LLM's width"):
        engine.model.embed_features(ids, torch.zeros(80, 8))


def test_mixed_hits_and_misses_equal_fresh_encodes_of_each_image(engine, astronaut, tower_calls):
    """Two of three images cached: only the third goes through the tower, and the result equals a fresh encode
    of each image on its own exactly. Against the uncached packed encode of all three (one tower call) it
    differs by summation-order rounding only: fp32 sums of the same terms in another order differ by at most
    about n * eps * sum|terms| (Higham, Accuracy and Stability, 2002, ch. 4); we assert 1e-5 * max|x|
    (about 100 fp32 ulps at the features' magnitude), far inside that bound for these <= 4608-term sums."""
    a, b, c = astronaut, astronaut.resize((56, 84)), astronaut.rotate(90).resize((112, 70))
    p_all = engine.prepare(_msgs(data_url(a), data_url(b), data_url(c)))
    each = torch.cat([_features(engine, engine.prepare(_msgs(data_url(x)))) for x in (a, b, c)])
    packed = _features(engine, p_all)
    engine.model.image_cache = cache = ImageFeatureCache(64 * 1024 * 1024)
    try:
        _features(engine, engine.prepare(_msgs(data_url(c), data_url(a))))
        calls_before = len(tower_calls)
        mixed = _features(engine, p_all)
    finally:
        engine.model.image_cache = None
    assert torch.equal(mixed, each)
    assert len(tower_calls) == calls_before + 1  # one tower call, for b only
    assert (cache.stats().hits, cache.stats().misses) == (2, 3)
    assert (mixed - packed).abs().max() <= 1e-5 * packed.abs().max()


def test_key_is_pixel_content_so_lossless_reencodes_hit_and_lossy_ones_miss(engine, astronaut):
    img = astronaut.resize((120, 90))
    png = engine.prepare(_msgs(_url(img, "PNG")))
    png9 = engine.prepare(_msgs(_url(img, "PNG", compress_level=9)))
    webp = engine.prepare(_msgs(_url(img, "WEBP", lossless=True)))
    jpeg = engine.prepare(_msgs(_url(img, "JPEG", quality=70)))
    k = image_keys(png.pixel_values, png.image_grid_thw)
    assert len(k) == 1 and len(k[0]) == 32
    assert image_keys(png9.pixel_values, png9.image_grid_thw) == k
    assert image_keys(webp.pixel_values, webp.image_grid_thw) == k
    assert image_keys(jpeg.pixel_values, jpeg.image_grid_thw) != k


def test_preprocessing_settings_are_part_of_the_key(profile, model_dir, engine, astronaut):
    """Another max_image_side gives another tower input, hence another key: no stale hit after a change."""
    cfg = profile.vlm.engine.model_copy(update={"max_image_side": 112})
    other = VLMEngine.from_config(cfg, model_dir)
    p1 = engine.prepare(_msgs(data_url(astronaut)))
    p2 = other.prepare(_msgs(data_url(astronaut)))
    assert p1.image_grid_thw.tolist() == [[1, 16, 16]] and p2.image_grid_thw.tolist() == [[1, 8, 8]]
    assert image_keys(p1.pixel_values, p1.image_grid_thw) != image_keys(p2.pixel_values, p2.image_grid_thw)


def test_training_path_bypasses_the_cache(engine, astronaut):
    p = engine.prepare(_msgs(data_url(astronaut)))
    engine.model.image_cache = cache = ImageFeatureCache(64 * 1024 * 1024)
    try:
        with torch.enable_grad():
            engine.model.image_features(p.pixel_values, p.image_grid_thw)
    finally:
        engine.model.image_cache = None
    assert cache.stats().misses == 0 and len(cache) == 0


def test_greedy_answer_with_the_cache_equals_without(engine, astronaut):
    msgs = _msgs(data_url(astronaut))
    ref = engine.complete(msgs, max_tokens=12, temperature=0).text
    engine.model.image_cache = cache = ImageFeatureCache(64 * 1024 * 1024)
    try:
        first = engine.complete(msgs, max_tokens=12, temperature=0).text
        again = engine.complete(msgs, max_tokens=12, temperature=0).text
    finally:
        engine.model.image_cache = None
    assert first == ref == again
    assert (cache.stats().hits, cache.stats().misses) == (1, 1)


def _t(n: int, fill: float) -> torch.Tensor:
    return torch.full((n, 8), fill)  # n * 8 * 4 bytes


def test_byte_bound_and_lru_eviction():
    cache = ImageFeatureCache(3 * 320)  # room for three 10x8 fp32 tensors (320 bytes each)
    for k in "abc":
        assert cache.put(k, _t(10, 1.0))
    assert cache.stats().bytes == 960
    assert cache.get("a") is not None  # a becomes the most recently used; b is now the oldest
    assert cache.put("d", _t(10, 2.0))
    assert "b" not in cache and all(k in cache for k in "acd")
    assert cache.put("e", _t(20, 3.0))  # 640 bytes: evicts c then a (oldest first)
    assert [k in cache for k in "acde"] == [False, False, True, True]
    s = cache.stats()
    assert s.bytes == 320 + 640 <= s.max_bytes and s.evictions == 3 and s.entries == 2
    assert not cache.put("huge", _t(40, 0.0))  # 1280 bytes > bound: refused, nothing evicted for it
    assert cache.stats().entries == 2 and cache.stats().bytes == 960
    assert cache.put("d", _t(5, 4.0))  # replacing an entry re-counts its bytes
    assert cache.stats().bytes == 640 + 160
    assert torch.equal(cache.get("d"), _t(5, 4.0))


def test_stored_value_is_a_cpu_copy():
    cache = ImageFeatureCache(1024)
    x = _t(2, 1.0)
    cache.put("x", x)
    x.fill_(9.0)
    assert torch.equal(cache.get("x"), _t(2, 1.0)) and cache.get("x").device.type == "cpu"
    with pytest.raises(ValueError):
        ImageFeatureCache(0)
    with pytest.raises(ValueError):
        image_keys(torch.zeros(3, 3, 14, 14), torch.tensor([[1, 2, 2]]))
