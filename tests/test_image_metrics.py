"""The Compare node's metrics (CPU, no ComfyUI): PSNR/SSIM definitions, the difference image, bad input."""

import math

import pytest
import torch

from comfyui_sparse_attention.nodes.image_metrics import CAP_DB, compare, psnr, ssim


def test_identical_images_are_perfect():
    a = torch.rand(3, 32, 40, 3, generator=torch.Generator().manual_seed(0))
    r = compare(a, a.clone())
    assert r.psnr == [CAP_DB] * 3 and all(abs(s - 1.0) < 1e-6 for s in r.ssim)
    assert torch.equal(r.difference, torch.zeros_like(a))


def test_psnr_matches_its_definition_and_orders_noise_levels():
    g = torch.Generator().manual_seed(1)
    a = torch.rand(2, 48, 48, 3, generator=g) * 0.8 + 0.1
    small = (a + 0.01 * torch.randn(a.shape, generator=g)).clamp(0, 1)
    large = (a + 0.1 * torch.randn(a.shape, generator=g)).clamp(0, 1)
    mse = (a - small).pow(2).flatten(1).mean(1)
    assert all(abs(p - (-10 * math.log10(float(m)))) < 1e-4 for p, m in zip(psnr(a, small), mse))
    assert min(psnr(a, small)) > max(psnr(a, large)) and min(ssim(a, small)) > max(ssim(a, large))
    r = compare(a, large, amplify=2.0)
    assert torch.allclose(r.difference, ((a - large).abs() * 2).clamp(0, 1))
    assert "PSNR" in r.text() and "worst frame" in r.text()


def test_bad_input_names_the_problem():
    a = torch.rand(1, 16, 16, 3)
    with pytest.raises(ValueError, match="differ in shape"):
        compare(a, torch.rand(2, 16, 16, 3))
    with pytest.raises(ValueError, match="image_b"):
        compare(a, torch.rand(16, 16, 3))
    with pytest.raises(ValueError, match="amplify"):
        compare(a, a, amplify=0.0)
    assert len(ssim(torch.rand(1, 5, 7, 3), torch.rand(1, 5, 7, 3))) == 1  # frames smaller than the window
