"""The papers' preprocessing (``data.crop=paper``): square resize, plain random crop + flip; centre crop to test."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from ddp_rank.config import load_config
from ddp_rank.data.reading import transforms
from ddp_rank.data.reading.transforms import TransformConfig, transform_from_config


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("size", [(300, 200), (120, 500), (256, 256)])
def test_output_sizes(size: tuple[int, int]) -> None:
    config = TransformConfig(resize=256, crop=224, mode="paper")
    image = noise_image(*size)
    assert transforms.train_transform(config)(image).shape == (3, 224, 224)
    assert transforms.test_transform(config)(image).shape == (3, 224, 224)


def test_crop_is_a_plain_crop_of_the_square_resized_image() -> None:
    """On an image already resize x resize the square resize is the identity: the training output must be one
    of its 224-px sub-squares (or its mirror), and the test output exactly the centre one."""
    image = noise_image(32, 32, seed=1)
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)
    config = TransformConfig(resize=32, crop=24, mode="paper")
    centre = transforms.test_transform(config)(image)
    assert torch.equal(centre, pixels[:, 4:28, 4:28])
    windows = {(t, left) for t in range(9) for left in range(9)}
    seen_positions, seen_flips = set(), set()
    torch.manual_seed(0)
    for _ in range(60):
        out = transforms.train_transform(config)(image)
        match = [
            (t, left, flip)
            for t, left in windows
            for flip in (False, True)
            if torch.equal(
                out,
                pixels[:, t : t + 24, left : left + 24].flip(-1)
                if flip
                else pixels[:, t : t + 24, left : left + 24],
            )
        ]
        assert len(match) == 1, "not a plain crop: a scale or aspect change crept in"
        seen_positions.add(match[0][:2])
        seen_flips.add(match[0][2])
    assert len(seen_positions) > 20 and seen_flips == {False, True}


def test_aspect_ratio_is_not_kept() -> None:
    """A 2:1 image is squashed, not cropped: its left and right quarters both stay in the centre crop."""
    pixels = np.full((100, 200, 3), 128, dtype=np.uint8)
    pixels[:, :50] = (255, 0, 0)
    pixels[:, 150:] = (0, 0, 255)
    out = transforms.test_transform(TransformConfig(resize=64, crop=56, mode="paper"))(
        Image.fromarray(pixels)
    )
    assert out[0, 28, 2] > 200 and out[2, 28, -3] > 200  # red on the left edge, blue on the right
    shorter = transforms.test_transform(TransformConfig(resize=64, crop=56))(Image.fromarray(pixels))
    assert shorter[0, 28, 2] < 200, "control: the shorter-side resize + centre crop cuts the left quarter off"


def test_deterministic_under_the_same_seed() -> None:
    image = noise_image(300, 200, seed=2)
    transform = transforms.train_transform(TransformConfig(resize=256, crop=224, mode="paper"))
    torch.manual_seed(5)
    a = [transform(image) for _ in range(3)]
    torch.manual_seed(5)
    b = [transform(image) for _ in range(3)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[1])


def test_config_setting_reaches_the_transform() -> None:
    cfg = load_config(None, ["data.crop=paper"])
    assert transform_from_config(cfg.data, augment=True).mode == "paper"
    assert transform_from_config(load_config().data).mode == "random_resized"
    with pytest.raises(ValueError, match="valid choices: random_resized, paper"):
        load_config(None, ["data.crop=papers"])


@pytest.mark.parametrize(("height", "width"), [(256, 341), (341, 256), (64, 64), (3, 200), (200, 3)])
def test_the_random_resized_crop_draws_as_torchvision_does(height: int, width: int) -> None:
    """The crop box from a generator of its own is torchvision's ``RandomResizedCrop.get_params`` draw for draw
    (same RNG state, same box), its fallback included (the thin images miss all ten tries)."""
    from torchvision.transforms import RandomResizedCrop

    dims = torch.empty(1, 1, 1).expand(1, height, width)
    for seed in range(200):
        torch.manual_seed(seed)
        expected = RandomResizedCrop.get_params(dims, [0.08, 1.0], [3 / 4, 4 / 3])
        got = transforms.random_resized_crop_box(
            height, width, (0.08, 1.0), (3 / 4, 4 / 3), torch.Generator().manual_seed(seed)
        )
        assert got == tuple(int(v) for v in expected), seed


def test_a_transform_with_its_own_generator_leaves_the_torch_rng_alone() -> None:
    image = noise_image(300, 200, seed=2)
    for mode in ("paper", "random_resized"):
        transform = transforms.train_transform(TransformConfig(resize=64, crop=56, mode=mode))
        torch.manual_seed(5)
        state = torch.get_rng_state()
        a = transform(image, torch.Generator().manual_seed(7))
        assert torch.equal(torch.get_rng_state(), state)
        torch.manual_seed(7)
        assert torch.equal(a, transform(image))  # the same draws as from the torch RNG seeded alike
