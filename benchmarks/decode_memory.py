"""Peak memory of decoding one large image: a 4096x4096 (16 Mpx) RGBA PNG, mostly transparent
so it compresses to a few hundred KB (the shape of a file that costs little to send and much to
decode). Each decode runs in a fresh process; the figure is its peak RSS over the RSS before the
decode, and that as a multiple of the decoded uint8 RGB image (H x W x 3 bytes).

    python benchmarks/decode_memory.py [--size 4096] [--mode RGBA|I;16|RGB]
"""
import argparse
import io
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import resource, sys
from vitp.data.decode import decode_image
data = open(sys.argv[1], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = decode_image(data, max_pixels=1 << 30)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before, peak, out.nbytes)
"""


def make_png(size: int, mode: str) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    if mode == "I;16":
        a = np.zeros((size, size), np.uint16)
        a[: size // 64] = rng.integers(0, 65536, (size // 64, size), dtype=np.uint16)
        im = Image.fromarray(a)
    else:
        a = np.zeros((size, size, 4), np.uint8)
        a[: size // 64] = rng.integers(0, 256, (size // 64, size, 4), dtype=np.uint8)
        im = Image.fromarray(a, "RGBA").convert(mode)
    buf = io.BytesIO()
    im.save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--mode", default="RGBA", choices=["RGBA", "I;16", "RGB"])
    args = ap.parse_args()
    data = make_png(args.size, args.mode)
    with tempfile.NamedTemporaryFile(suffix=".png", delete=False) as f:
        f.write(data)
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run([sys.executable, "-c", CHILD, f.name], capture_output=True, text=True,
                             cwd=root, check=True).stdout.split()
    finally:
        os.unlink(f.name)
    before, peak, decoded = (int(x) for x in out)
    over = (peak - before) * 1024  # ru_maxrss is in KiB on Linux
    print(f"{args.size}x{args.size} {args.mode} PNG, {len(data) / 1e3:.0f} KB: decode peak "
          f"+{over / 1e6:.0f} MB over the process before it = {over / decoded:.1f}x the decoded "
          f"uint8 RGB image ({decoded / 1e6:.0f} MB)")


if __name__ == "__main__":
    main()
