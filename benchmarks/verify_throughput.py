"""How many images per second `cachedoctor verify` encodes, with an SDXL-sized VAE.

    python benchmarks/verify_throughput.py [--size 256] [--device cpu|cuda] [--batch 8] [--n 16]

The VAE is an AutoencoderKL with SDXL's VAE architecture (block_out_channels 128/256/512/512,
two layers per block, factor 8) and random weights: encoding costs what the real one costs,
and nothing is downloaded. It measures what verify spends its time on, the batched encode of
one bucket (cachedoctor.verify.encode.Fresh), and apart from it the pixels the trainer
encodes (PNG decode, resize, crop: repair/reencode.pixels). It counts the encoder's FLOPs per
image (torch.utils.flop_counter), so that a measurement on one machine can be carried to
another: images/s there ≈ that machine's sustained FLOP/s ÷ FLOPs per image.

verify loads the VAE as diffusers does by default, in float32 (whatever dtype its weights were
saved in), so that is what this measures. A verified entry costs one encode; an entry that
does not match up to 13 more (mirrored, and 12 neighbouring crops where the resized image
leaves room). Needs diffusers (pip install 'cachedoctor[diffusers]').
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="image side in pixels")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=16, help="images to encode")
    args = parser.parse_args()

    import torch
    from diffusers import AutoencoderKL
    from torch.utils.flop_counter import FlopCounterMode

    from cachedoctor.fixtures.images import write_png
    from cachedoctor.layouts.entries import EntryFormat, Geometry
    from cachedoctor.repair.encoders import resolve
    from cachedoctor.repair.reencode import pixels
    from cachedoctor.verify.encode import Fresh

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4,
                            block_out_channels=(128, 256, 512, 512), layers_per_block=2,
                            latent_channels=4, sample_size=1024, scaling_factor=0.13025)
        vae.save_pretrained(tmp)
        encoder = resolve(f"diffusers:{tmp}")
        fresh = Fresh(encoder, args.device, args.batch)
        fresh.prepare()
        side = args.size
        image = write_png(Path(tmp) / "image.png", side + side // 4, side, seed=1)
        geometry = Geometry((side + side // 4, side), (side + side // 4, side), (side // 8, 0, side, side))
        start = time.perf_counter()
        images = [pixels(str(image), geometry) for _ in range(args.n)]
        pixel_s = (time.perf_counter() - start) / args.n
        fmt = EntryFormat("zip", None, "float32", 4, scaled=True)
        fresh.encode(images[: args.batch], fmt)  # warm-up: kernels, allocator
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        fresh.encode(images, fmt)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        with FlopCounterMode(display=False) as counter, torch.no_grad():
            x = images[0][None].to(args.device).float() / 127.5 - 1
            encoder.vae.encode(x)
        flops = counter.get_total_flops()
    print(f"{side}x{side} float32 on {args.device}, batch {args.batch}: "
          f"{args.n / seconds:.2f} images/s encoding ({flops / 1e9:.1f} GFLOP per image, "
          f"{flops * args.n / seconds / 1e12:.3f} TFLOP/s sustained); "
          f"pixels (PNG decode, resize, crop) {pixel_s * 1000:.1f} ms per image")


if __name__ == "__main__":
    main()
