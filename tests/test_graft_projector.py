"""The projector's image-context option (grafting/projector.py): each image token also sees its image's mean merge
group, per image of a packed batch, and nothing else changes (issue 27, ninth round)."""

from __future__ import annotations

import pytest
import torch

from grafting.projector import GraftProjector, GraftProjectorConfig


def _projector(image_context: bool, seed: int = 0) -> GraftProjector:
    torch.manual_seed(seed)
    return GraftProjector(GraftProjectorConfig(vision_hidden_size=8, merge_size=4, mid_size=16, llm_hidden_size=12,
                                               image_context=image_context)).eval()


def test_a_packed_batch_gives_each_image_the_rows_it_gets_alone():
    proj = _projector(True)
    g = torch.Generator().manual_seed(1)
    images = [torch.randn(n, 4, 8, generator=g) for n in (3, 5, 1)]
    with torch.no_grad():
        packed = proj(torch.cat(images), [3, 5, 1])
        alone = torch.cat([proj(x, [x.shape[0]]) for x in images])
        # The image means are the same sums packed or alone; only the GEMMs of other row counts may sum in another
        # order. Bound (Higham's inner-product bound, K * u * sum |w||x| per layer, u = 2^-24, doubled for the two
        # orders compared; GELU is 1.13-Lipschitz): the middle layer's error, through |W_out|, plus the output's.
        x = proj.pre_norm(torch.cat(images)).reshape(9, -1)
        means = torch.cat([part.mean(0, keepdim=True).expand(len(part), -1) for part in x.split([3, 5, 1])])
        u = 2.0**-24
        mid = x.abs() @ proj.in_proj.weight.abs().T + means.abs() @ proj.context_proj.weight.abs().T
        mid_err = 2 * (2 * 32 + 1) * u * (mid + proj.in_proj.bias.abs())
        h = proj.act(proj.in_proj(x) + proj.context_proj(means))
        bound = 1.13 * mid_err @ proj.out_proj.weight.abs().T + 2 * 17 * u * (h.abs() @ proj.out_proj.weight.abs().T
                                                                              + proj.out_proj.bias.abs())
    assert packed.shape == (9, 12) and ((packed - alone).abs() <= bound).all()


def test_every_token_sees_its_own_image_and_no_other():
    proj = _projector(True)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, 8, generator=g)
    y = x.clone()
    y[0] += 1.0  # one merge group of the first image changes
    with torch.no_grad():
        a, b = proj(x, [2, 4]), proj(y, [2, 4])
    assert not torch.equal(a[1], b[1])  # the other token of the same image reads the new image mean
    assert torch.equal(a[2:], b[2:])  # the second image is untouched


def test_without_the_option_it_is_the_kimi_projector_and_ignores_the_image_split():
    proj = _projector(False)
    assert proj.context_proj is None
    x = torch.randn(5, 4, 8)
    with torch.no_grad():
        ref = proj.out_proj(proj.act(proj.in_proj(proj.pre_norm(x).reshape(5, -1))))
        assert torch.equal(proj(x), ref) and torch.equal(proj(x, [2, 3]), ref)


@pytest.mark.parametrize("counts", [None, [2, 2], [5, 0], [6, -1]])
def test_an_image_context_projector_refuses_a_missing_or_wrong_image_split(counts):
    with pytest.raises(ValueError, match="token count"):
        _projector(True)(torch.randn(5, 4, 8), counts)


def test_the_option_survives_save_and_load(tmp_path):
    proj = _projector(True)
    proj.save_pretrained(tmp_path / "p")
    loaded = GraftProjector.from_pretrained(tmp_path / "p")
    assert loaded.config.image_context and loaded.context_proj is not None
    x = torch.randn(4, 4, 8)
    with torch.no_grad():
        assert torch.equal(loaded.eval()(x, [1, 3]), proj(x, [1, 3]))
