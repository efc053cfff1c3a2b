"""Sparse attention through the HTTP API: `sparsity` per request (openai SDK, `extra_body`), on the served cpu profile."""


import openai
import pytest

from tests.conftest import wait_for_video


def _wait(client, video_id, timeout=240):
    return wait_for_video(client, video_id, timeout)


def test_video_job_with_sparsity_completes(openai_client):
    v = openai_client.videos.create(model="chimera-video", prompt="a red kite over the sea", seconds="4",
                                    size="128x128", extra_body={"sparsity": 0.125, "seed": 7,
                                                                "num_inference_steps": 4})
    assert v.status == "queued"
    done = _wait(openai_client, v.id)
    assert done.status == "completed", done.error
    assert done.progress == 100 and done.size == "128x128"
    mp4 = openai_client.videos.download_content(v.id).read()
    assert mp4[4:8] == b"ftyp" and len(mp4) > 1000


@pytest.mark.parametrize("sparsity", [0, 1.5, "lots"])
def test_out_of_range_sparsity_is_a_400(openai_client, sparsity):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.videos.create(model="chimera-video", prompt="a red kite", seconds="4", size="128x128",
                                    extra_body={"sparsity": sparsity})
    assert err.value.status_code == 400
    assert err.value.body["param"] == "sparsity"
