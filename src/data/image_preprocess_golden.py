#!/usr/bin/env python3
"""Makes tests/golden/preprocess/: synthetic images (JPEG/PNG/WebP, grey, palette, RGBA, 16-bit,
EXIF-rotated), cases.json and, per case, <name>.safetensors with transformers' (slow, PIL-based)
Qwen2VLImageProcessor output under Qwen3.5's settings. Run where transformers is installed:

    python3 src/data/image_preprocess_golden.py [--out tests/golden/preprocess]

Needs numpy, Pillow, transformers, safetensors. Checked by src/data/image_preprocess_golden_test.cc.
"""
import argparse
import json
import os

import numpy as np
from PIL import Image
from safetensors.numpy import save_file
from transformers import Qwen2VLImageProcessor
from transformers.image_utils import load_image


def photo_like(height, width, seed):
    """Smooth colour fields plus edges and noise, so resizing has something to do."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    r = 128 + 100 * np.sin(x / (7 + seed)) * np.cos(y / 11)
    g = 255 * (x + y) / (height + width)
    b = np.where((x // 23 + y // 17) % 2 == 0, 40, 220)
    image = np.stack([r, g, b], axis=-1) + rng.normal(0, 12, (height, width, 3))
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")


def exif_with_orientation(orientation):
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def make_images(folder):
    """Returns [(name, file, min_pixels, max_pixels)] after writing the image files."""
    default_min, default_max = 65536, 16777216
    cases = []

    def add(name, image, ext, min_pixels=default_min, max_pixels=default_max, **save_args):
        file = f"{name}.{ext}"
        image.save(os.path.join(folder, file), **save_args)
        cases.append({"name": name, "file": file, "min_pixels": min_pixels, "max_pixels": max_pixels})

    add("jpeg_640x480", photo_like(480, 640, 1), "jpg", quality=90)
    add("jpeg_small_upscaled", photo_like(50, 100, 2), "jpg", quality=95)
    add("jpeg_max_pixels", photo_like(1200, 900, 3), "jpg", max_pixels=256 * 256, quality=90)
    add("jpeg_min_pixels", photo_like(300, 200, 4), "jpg", min_pixels=512 * 512, quality=90)
    add("jpeg_exif_rotate_cw", photo_like(300, 500, 5), "jpg", quality=90, exif=exif_with_orientation(6))
    add("jpeg_exif_mirror", photo_like(320, 200, 6), "jpg", quality=90, exif=exif_with_orientation(2))
    add("jpeg_grey", photo_like(333, 251, 7).convert("L"), "jpg", quality=90)
    add("jpeg_odd_sizes", photo_like(517, 389, 8), "jpg", quality=85)
    add("png_rgb", photo_like(256, 384, 9), "png")
    add("png_rgba", photo_like(270, 330, 10).convert("RGBA"), "png")
    add("png_palette", photo_like(240, 360, 11).convert("P"), "png")
    add("png_grey_alpha", photo_like(200, 300, 12).convert("LA"), "png")
    grey16 = (np.asarray(photo_like(128, 160, 13).convert("L")).astype(np.uint16) * 257)
    add("png_grey16", Image.fromarray(grey16), "png")
    add("png_thin", photo_like(40, 2000, 14), "png")
    add("webp_lossy", photo_like(300, 400, 15), "webp", quality=80)
    add("webp_lossless_rgba", photo_like(250, 350, 16).convert("RGBA"), "webp", lossless=True)
    return cases


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="tests/golden/preprocess")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cases = make_images(args.out)
    for case in cases:
        processor = Qwen2VLImageProcessor(
            size={"shortest_edge": case["min_pixels"], "longest_edge": case["max_pixels"]},
            patch_size=16, temporal_patch_size=2, merge_size=2,
            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        image = load_image(os.path.join(args.out, case["file"]))  # applies EXIF orientation
        output = processor(images=[image], return_tensors="np")
        save_file({"pixel_values": np.ascontiguousarray(output["pixel_values"], dtype=np.float32),
                   "image_grid_thw": np.ascontiguousarray(output["image_grid_thw"], dtype=np.int64)},
                  os.path.join(args.out, case["name"] + ".safetensors"))
        print(case["name"], output["image_grid_thw"].tolist(), output["pixel_values"].shape)
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump(cases, f, indent=1)


if __name__ == "__main__":
    main()
