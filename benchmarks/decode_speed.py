"""JPEG decode speed of every installed decoder, one process, on a smooth photo-like image
re-encoded by Pillow at quality 90: 112 x 112 (a face crop) and 500 x 375 (an ImageNet photo);
best of 3 passes. The order of ``trainperf.data.decode.DECODERS`` rests on it.

    python benchmarks/decode_speed.py
"""

import io, time, numpy as np
from PIL import Image
from trainperf.data import decode
rng = np.random.default_rng(0)
def photo(h, w):
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    img = np.stack([127 + 100*np.sin(0.03*xx + 0.02*yy + c) for c in range(3)], -1) + rng.normal(0, 12, (h, w, 3))
    b = io.BytesIO(); Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(b, "JPEG", quality=90); return b.getvalue()
for h, w, n in ((112, 112, 3000), (375, 500, 300)):
    data = photo(h, w)
    for name in decode.available():
        f = decode.get_decoder(name); f(data)
        best = min((lambda t: (sum(f(data) is not None for _ in range(n)), time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(3))
        print(f"{w}x{h} {name}: {n / best:.0f} decodes/s")
