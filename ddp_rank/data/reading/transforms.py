"""Decoding and the papers' image transforms, split so that the per-image work stays in uint8.

Two crops (``TransformConfig.mode``):

- ``paper``, the FastAP and PNP papers' preprocessing: resize to 256 x 256 (the aspect ratio is not kept), a
  random 224 x 224 crop and a horizontal flip for training; resize to 256 x 256 and the centre 224 crop for
  testing.
- ``random_resized``: resize the shorter side to 256, random-resized crop 224 (area scale and aspect jitter as
  torchvision's RandomResizedCrop), flip; test: shorter side 256, centre crop 224.

Sizes are configurable (the demo uses small images). Per image we decode with PIL (JPEG
``draft`` mode decodes big files directly at a reduced scale), do resize + crop (+ flip) as ONE resample of the
PIL image and convert to a uint8 tensor; the float conversion and the ImageNet normalisation run once on the stacked batch,
which is cheaper than per image. With ``pixels="uint8"`` the batch stays uint8 and the consumer converts it where it
computes (the trainer: on the GPU, after a copy of a quarter of the float32 bytes); ``uint8_to_unit`` is that
conversion, bit-identical to the float path's.

Only image bytes are decoded (jpg / png / webp through PIL, by ``decode.decode_image``, which this module
re-exports); no generic or pickle decoder exists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from PIL import Image

from ddp_rank.data.reading.decode import DEFAULT_MAX_IMAGE_PIXELS
from ddp_rank.data.reading.decode import (
    decode_image as decode_image,  # re-exported: the transforms' callers decode
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

ImageTransform = Callable[..., torch.Tensor]
"""``transform(image, generator=None) -> uint8 [3, H, W]``: the random draws come from ``generator`` (the torch
RNG when None). The training stream gives each image a generator of its own, so reading batches in a background
thread never touches the RNG the model draws from."""


CROP_MODES = ("random_resized", "paper")
PIXEL_TYPES = ("float", "uint8")


@dataclass(frozen=True)
class TransformConfig:
    """Sizes of the papers' augmentation (resize 256, crop 224), configurable, and the crop mode."""

    resize: int = 256
    crop: int = 224
    crop_scale: tuple[float, float] = (0.08, 1.0)
    """RandomResizedCrop area range (torchvision's default)."""
    flip: bool = True
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    mode: str = "random_resized"
    """``paper`` (square resize, plain random crop) or ``random_resized`` (see the module doc)."""
    pixels: str = "float"
    """Batches of ``float`` (normalised float32) or ``uint8`` (raw 0-255: ``mean`` / ``std`` are then the
    consumer's to apply)."""
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    """Largest image decoded (width x height from its header, ``data.max_image_pixels``): see ``data.reading.decode``."""

    def __post_init__(self) -> None:
        if self.crop > self.resize:
            raise ValueError(f"crop ({self.crop}) must not exceed resize ({self.resize})")
        if self.mode not in CROP_MODES:
            raise ValueError(f"crop mode {self.mode!r}: valid are {', '.join(CROP_MODES)}")
        if self.pixels not in PIXEL_TYPES:
            raise ValueError(f"pixels {self.pixels!r}: valid are {', '.join(PIXEL_TYPES)}")
        if self.max_pixels < 1:
            raise ValueError(f"max_pixels ({self.max_pixels}) must be a positive number of pixels")


class ImageSizes(Protocol):
    """The image keys of the config's ``data`` section (``DataConfig``)."""

    @property
    def resize_size(self) -> int: ...
    @property
    def image_size(self) -> int: ...
    @property
    def crop_scale_min(self) -> float: ...
    @property
    def crop(self) -> str: ...
    @property
    def max_image_pixels(self) -> int: ...


def transform_from_config(
    data: ImageSizes, *, augment: bool = False, pixels: str = "float"
) -> TransformConfig:
    """The transform of ``data.crop`` at the configured sizes, pixels in [0, 1] (or uint8): what our models take.

    No mean / std here: the model applies its backbone's own input normalisation (``EmbeddingNet``).
    """
    return TransformConfig(
        resize=data.resize_size,
        crop=data.image_size,
        crop_scale=(data.crop_scale_min, 1.0),
        flip=augment,
        mean=(0.0, 0.0, 0.0),
        std=(1.0, 1.0, 1.0),
        mode=data.crop,
        pixels=pixels,
        max_pixels=data.max_image_pixels,
    )


def _virtual_size(width: int, height: int, resize: int) -> tuple[int, int, float]:
    """Size of the image after "resize the shorter side to ``resize``" (as torchvision rounds it), and the scale."""
    scale = resize / min(width, height)
    if width <= height:
        return resize, int(resize * height / width), scale
    return int(resize * width / height), resize, scale


def _to_uint8_chw(image: Image.Image) -> torch.Tensor:
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1)


class ResizedCropFlip:
    """Resize the shorter side to ``resize``, random resized crop to ``crop``, random flip: ONE PIL resample.

    The crop box is drawn on the virtually resized image exactly as torchvision's RandomResizedCrop draws it
    (same parameter sampler, torch RNG) and mapped back to the original pixels, so the distribution of crops is
    the papers' while the image is resampled once instead of twice (faster, and sharper).
    """

    def __init__(self, config: TransformConfig) -> None:
        self.config = config
        self.ratio = (3.0 / 4.0, 4.0 / 3.0)

    def __call__(self, image: Image.Image, generator: torch.Generator | None = None) -> torch.Tensor:
        width, height, scale = _virtual_size(*image.size, self.config.resize)
        top, left, h, w = random_resized_crop_box(
            height, width, self.config.crop_scale, self.ratio, generator
        )
        box = (left / scale, top / scale, (left + w) / scale, (top + h) / scale)
        return _crop_and_flip(image, box, self.config, generator)


class ResizeCenterCrop:
    """Resize the shorter side to ``resize`` and take the centre ``crop``, as one PIL resample."""

    def __init__(self, config: TransformConfig) -> None:
        self.config = config

    def __call__(self, image: Image.Image, generator: torch.Generator | None = None) -> torch.Tensor:
        width, height, scale = _virtual_size(*image.size, self.config.resize)
        crop = self.config.crop
        top, left = round((height - crop) / 2.0), round((width - crop) / 2.0)
        box = (left / scale, top / scale, (left + crop) / scale, (top + crop) / scale)
        return _to_uint8_chw(image.resize((crop, crop), Image.Resampling.BILINEAR, box=box))


def random_resized_crop_box(
    height: int,
    width: int,
    scale: Sequence[float],
    ratio: Sequence[float],
    generator: torch.Generator | None = None,
) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` of a random crop of a height x width image covering ``scale`` of its area with an
    aspect ratio in ``ratio`` (log-uniform): torchvision's ``RandomResizedCrop.get_params``, draw for draw (the
    same numbers from the same RNG state), with the draws taken from ``generator``; after 10 misses, the centre
    crop of the largest box whose ratio is within bounds."""
    area = height * width
    low, high = (float(x) for x in torch.log(torch.tensor(ratio)))  # float32 logs, as torchvision takes them
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1], generator=generator).item()
        aspect = torch.exp(torch.empty(1).uniform_(low, high, generator=generator)).item()
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(torch.randint(0, height - h + 1, size=(1,), generator=generator).item())
            left = int(torch.randint(0, width - w + 1, size=(1,), generator=generator).item())
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        h, w = height, round(height * max(ratio))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _square_crop_box(
    image: Image.Image, resize: int, top: int, left: int, crop: int
) -> tuple[float, float, float, float]:
    """The box in original pixels of the ``crop`` square at (top, left) of the image squashed to resize x resize."""
    sx, sy = image.size[0] / resize, image.size[1] / resize
    return (left * sx, top * sy, (left + crop) * sx, (top + crop) * sy)


class SquareResizeCropFlip:
    """The papers' training crop: resize to ``resize`` x ``resize``, random ``crop`` square, random flip.

    As in :class:`ResizedCropFlip`, the crop is mapped back to the original pixels so the image is resampled
    once; the crop position and the flip come from the torch RNG (the stream seeds it per sample).
    """

    def __init__(self, config: TransformConfig) -> None:
        self.config = config

    def __call__(self, image: Image.Image, generator: torch.Generator | None = None) -> torch.Tensor:
        resize, crop = self.config.resize, self.config.crop
        top = int(torch.randint(0, resize - crop + 1, (1,), generator=generator).item())
        left = int(torch.randint(0, resize - crop + 1, (1,), generator=generator).item())
        return _crop_and_flip(image, _square_crop_box(image, resize, top, left, crop), self.config, generator)


class SquareResizeCenterCrop:
    """The papers' test crop: resize to ``resize`` x ``resize`` and take the centre ``crop`` square."""

    def __init__(self, config: TransformConfig) -> None:
        self.config = config

    def __call__(self, image: Image.Image, generator: torch.Generator | None = None) -> torch.Tensor:
        resize, crop = self.config.resize, self.config.crop
        offset = round((resize - crop) / 2.0)
        box = _square_crop_box(image, resize, offset, offset, crop)
        return _to_uint8_chw(image.resize((crop, crop), Image.Resampling.BILINEAR, box=box))


def train_transform(config: TransformConfig) -> ImageTransform:
    return SquareResizeCropFlip(config) if config.mode == "paper" else ResizedCropFlip(config)


def test_transform(config: TransformConfig) -> ImageTransform:
    return SquareResizeCenterCrop(config) if config.mode == "paper" else ResizeCenterCrop(config)


def normalize_batch(images: Sequence[torch.Tensor], config: TransformConfig) -> torch.Tensor:
    """Stack uint8 [3, H, W] images into a normalised float32 [n, 3, H, W] batch (one conversion pass)."""
    stacked = torch.stack(list(images))
    batch = torch.empty(stacked.shape, dtype=torch.float32)
    batch.copy_(stacked)
    scale = torch.tensor([1.0 / (255.0 * s) for s in config.std]).view(1, 3, 1, 1)
    shift = torch.tensor([m / s for m, s in zip(config.mean, config.std)]).view(1, 3, 1, 1)
    return batch.mul_(scale).sub_(shift)


def collate_images(images: Sequence[torch.Tensor], config: TransformConfig) -> torch.Tensor:
    """The batch as ``config.pixels`` asks: normalised float32, or the stacked uint8 images as they are."""
    if config.pixels == "uint8":
        return torch.stack(list(images))
    return normalize_batch(images, config)


def uint8_to_unit(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels to float32 in [0, 1], on the tensor's device, bit-identical to ``normalize_batch`` with mean 0
    and std 1 (the same float32 multiply by 1/255: a division would round differently).

    A Python scalar, not a tensor built for the device: ``torch.tensor(1 / 255, device="cuda")`` is a blocking
    copy from host memory, which makes the host wait for the GPU at every call. The scalar is applied in float32
    (the multiply's compute type), the same number as the float path's float32 scale."""
    return images.to(torch.float32).mul_(1.0 / 255.0)


def _crop_and_flip(
    image: Image.Image,
    box: tuple[float, float, float, float],
    config: TransformConfig,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """``box`` of ``image`` resampled to the ``crop`` square in one PIL resize, mirrored half the time with
    ``config.flip`` (the draw from ``generator``), as a uint8 CHW tensor."""
    out = image.resize((config.crop, config.crop), Image.Resampling.BILINEAR, box=box)
    if config.flip and torch.rand(1, generator=generator).item() < 0.5:
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return _to_uint8_chw(out)
