# Golden image-preprocessing set: synthetic PNG/JPEG images and the pixel_values /
# image_grid_thw that transformers' Qwen2VLImageProcessor (Qwen3.5 settings) makes of them.
import importlib
import json
import math
import os

import numpy as np
from PIL import Image

kPatchSize = 16
kTemporalPatchSize = 2
kMergeSize = 2
kFactor = kPatchSize * kMergeSize
kMean = [0.5, 0.5, 0.5]
kStd = [0.5, 0.5, 0.5]
# Qwen3.5-35B-A3B preprocessor_config.json size (min / max pixels).
kQwen35MinPixels = 65536
kQwen35MaxPixels = 16777216


class PreprocessCase:
    def __init__(self, name, description, height, width, mode, file_format, min_pixels, max_pixels):
        self.name = name
        self.description = description
        self.height = height
        self.width = width
        self.mode = mode  # PIL mode of the stored file: "RGB" or "RGBA"
        self.file_format = file_format  # "png" or "jpg"
        self.min_pixels = min_pixels
        self.max_pixels = max_pixels


def all_cases():
    # Custom min/max pixels keep the files small; the Qwen3.5 values are used where they
    # do not blow up the patch count (the downscale case needs a small max on purpose).
    return [
        PreprocessCase("upscale_png", "40x50 RGB PNG, smaller than min_pixels=8192 -> upscaled",
                       40, 50, "RGB", "png", 8192, kQwen35MaxPixels),
        PreprocessCase("downscale_jpg", "300x220 RGB JPEG, larger than a custom max_pixels=12288 -> "
                       "downscaled", 300, 220, "RGB", "jpg", 1024, 12288),
        PreprocessCase("tall_png", "420x34 RGB PNG, aspect ratio 12.4 (tall), within bounds: rounding only",
                       420, 34, "RGB", "png", 1024, kQwen35MaxPixels),
        PreprocessCase("wide_jpg", "36x400 RGB JPEG, aspect ratio 11.1 (wide), within bounds; "
                       "400/32 = 12.5 rounds half-to-even to 12", 36, 400, "RGB", "jpg", 1024, kQwen35MaxPixels),
        PreprocessCase("rgba_png", "64x80 RGBA PNG with varying alpha: shows how the processor "
                       "drops/composites alpha; 80/32 = 2.5 rounds half-to-even to 2", 64, 80, "RGBA", "png", 1024, kQwen35MaxPixels),
    ]


def smart_resize(height, width, factor, min_pixels, max_pixels):
    """Independent restatement of the Qwen2-VL resize rule, used only to cross-check."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def synth_image(case, seed):
    """Smooth gradients, a few hard edges and noise: exercises interpolation and clamping."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:case.height, 0:case.width].astype(np.float64)
    y /= max(case.height - 1, 1)
    x /= max(case.width - 1, 1)
    channels = [
        255 * (0.5 + 0.5 * np.sin(6.0 * x + 2.0 * y)),
        255 * y,
        255 * (0.5 + 0.5 * np.cos(9.0 * x * y + 1.0)),
    ]
    image = np.stack(channels, axis=-1)
    image[(x > 0.3) & (x < 0.45)] = [250, 20, 10]  # hard vertical bar
    band = (y > 0.6) & (y < 0.7)
    image[band, 2] = 255  # hard horizontal band in blue
    image += rng.normal(0, 12, image.shape)
    image = np.clip(np.rint(image), 0, 255).astype(np.uint8)
    if case.mode == "RGBA":
        alpha = np.clip(np.rint(255 * (0.2 + 0.8 * x)), 0, 255).astype(np.uint8)
        alpha[: case.height // 4] = 0  # fully transparent top rows
        image = np.concatenate([image, alpha[..., None]], axis=-1)
    return Image.fromarray(image)  # uint8 HxWx3 -> RGB, HxWx4 -> RGBA


def _processor_classes():
    """The default (torchvision-backed in v5) processor first, then the PIL backend if present."""
    transformers = importlib.import_module("transformers")
    found = []
    for name in ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorPil"):
        try:
            found.append((name, getattr(transformers, name)))
        except Exception as error:  # missing class or a backend (torchvision) that fails to import
            print(f"  note: {name} unavailable: {error}")
    if not found:
        raise RuntimeError(f"transformers {transformers.__version__} has no usable Qwen2VLImageProcessor")
    return found


def _make_processor(cls, case):
    return cls(
        size={"shortest_edge": case.min_pixels, "longest_edge": case.max_pixels},
        patch_size=kPatchSize,
        temporal_patch_size=kTemporalPatchSize,
        merge_size=kMergeSize,
        image_mean=kMean,
        image_std=kStd,
        do_resize=True,
        do_rescale=True,
        rescale_factor=1 / 255,
        do_normalize=True,
        do_convert_rgb=True,
    )


def _run_processor(cls, case, image):
    out = _make_processor(cls, case)(images=[image], return_tensors="pt")
    return out["pixel_values"].float().numpy(), out["image_grid_thw"].numpy().astype(np.int64)


def run_preprocess_cases(out_dir, versions, log):
    import torch
    from safetensors.numpy import save_file

    pre_dir = os.path.join(out_dir, "preprocess")
    os.makedirs(pre_dir, exist_ok=True)
    classes = _processor_classes()
    primary_name, primary_cls = classes[0]
    summary = {"processor_class": primary_name, "patch_size": kPatchSize,
               "temporal_patch_size": kTemporalPatchSize, "merge_size": kMergeSize,
               "image_mean": kMean, "image_std": kStd, "rescale_factor": "1/255",
               "resample": "bicubic (processor default)",
               "qwen35_default_min_pixels": kQwen35MinPixels, "qwen35_default_max_pixels": kQwen35MaxPixels,
               "notes": "each <name>.safetensors holds pixel_values f32 [N,1536], image_grid_thw int64 [1,3] "
                        "and decoded uint8 [H,W,C] (the image as PIL decodes the stored file, before any "
                        "RGB conversion) so decoding and resizing can be tested apart.",
               "cases": [], **versions}
    total = 0
    for index, case in enumerate(all_cases()):
        torch.manual_seed(2000 + index)
        image = synth_image(case, 2000 + index)
        path = os.path.join(pre_dir, f"{case.name}.{case.file_format}")
        if case.file_format == "jpg":
            image.save(path, format="JPEG", quality=90)
        else:
            image.save(path, format="PNG")
        decoded = Image.open(path)
        decoded.load()
        pixel_values, grid = _run_processor(primary_cls, case, decoded)
        want_h, want_w = smart_resize(case.height, case.width, kFactor, case.min_pixels, case.max_pixels)
        want_grid = [1, want_h // kPatchSize, want_w // kPatchSize]
        if grid.tolist() != [want_grid]:
            raise RuntimeError(f"preprocess {case.name}: processor grid {grid.tolist()} != smart_resize "
                               f"{want_grid} for {case.height}x{case.width}")
        if pixel_values.shape != (int(np.prod(want_grid)), 3 * kTemporalPatchSize * kPatchSize ** 2):
            raise RuntimeError(f"preprocess {case.name}: pixel_values shape {pixel_values.shape}")
        if not np.isfinite(pixel_values).all():
            raise RuntimeError(f"preprocess {case.name}: non-finite pixel_values")
        other = {}
        for name, cls in classes[1:]:
            alt_values, alt_grid = _run_processor(cls, case, decoded)
            if alt_grid.tolist() == grid.tolist():
                other[name] = float(np.abs(alt_values - pixel_values).max())
            else:
                other[name] = f"grid differs: {alt_grid.tolist()}"
        tensors = {"pixel_values": np.ascontiguousarray(pixel_values, dtype=np.float32),
                   "image_grid_thw": np.ascontiguousarray(grid, dtype=np.int64),
                   "decoded": np.ascontiguousarray(np.asarray(decoded), dtype=np.uint8)}
        save_file(tensors, os.path.join(pre_dir, f"{case.name}.safetensors"))
        entry = {"name": case.name, "file": os.path.basename(path), "description": case.description,
                 "height": case.height, "width": case.width, "mode": case.mode,
                 "min_pixels": case.min_pixels, "max_pixels": case.max_pixels,
                 "resized_height": want_h, "resized_width": want_w, "image_grid_thw": grid.tolist()[0],
                 "max_abs_diff_vs_other_processors": other}
        summary["cases"].append(entry)
        log(f"  preprocess {case.name}: {case.height}x{case.width} -> {want_h}x{want_w}, grid "
            f"{grid.tolist()[0]}, pixel_values {list(pixel_values.shape)} range "
            f"[{pixel_values.min():.3f}, {pixel_values.max():.3f}], other backends {other}")
        total += os.path.getsize(path) + os.path.getsize(os.path.join(pre_dir, f"{case.name}.safetensors"))
    with open(os.path.join(pre_dir, "cases.json"), "w") as handle:
        json.dump(summary, handle, indent=1)
    log(f"  wrote {pre_dir} ({total / 1e6:.2f} MB)")
    return total, len(summary["cases"])
