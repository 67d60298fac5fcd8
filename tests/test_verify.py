"""Verification sets (insightface .bin): reading, writing, refusing bad or hostile files; the
10-fold evaluation against a plain-Python reference; the synthetic held-out set."""

from __future__ import annotations

import math
import os
import pickle
import struct
from io import BytesIO

import numpy as np
import pytest
from PIL import Image

from trainperf.cli import main
from trainperf.data.layout import open_dataset
from trainperf.data.synth import synthesize
from trainperf.data.binset import VerificationSet, VerificationSetError, read_bin, write_bin
from trainperf.verify import evaluate, format_table


def jpeg(seed: int, h: int = 12, w: int = 12) -> bytes:
    # smooth gradients plus a little noise: survives JPEG closely enough to compare
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = rng.integers(40, 200, 3)
    img = base + 5 * (x[..., None] + y[..., None]) + rng.integers(0, 4, (h, w, 3))
    out = BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(out, "JPEG", quality=95)
    return out.getvalue()


def pil_rgb(data: bytes) -> np.ndarray:
    with Image.open(BytesIO(data)) as img:
        return np.array(img.convert("RGB"))


IMAGES = [jpeg(i) for i in range(6)]
ISSAME = [True, False, True]


# --- reading and writing ---------------------------------------------------------------------

def test_write_then_read(tmp_path):
    path = tmp_path / "lfw.bin"
    write_bin(path, IMAGES, ISSAME)
    assert not (tmp_path / "lfw.bin.partial").exists()
    got = read_bin(path)
    assert isinstance(got, VerificationSet)
    assert (got.name, got.path, got.pairs) == ("lfw", str(path), 3)
    assert got.images.dtype == np.uint8 and got.images.shape == (6, 12, 12, 3)
    assert got.issame.dtype == bool and got.issame.tolist() == ISSAME
    for image, data in zip(got.images, IMAGES):
        # decoders may differ by a grey level in chroma upsampling, not more
        assert np.abs(image.astype(int) - pil_rgb(data)).max() <= 2
    assert read_bin(path, size=7).images.shape == (6, 7, 7, 3)


@pytest.mark.parametrize("protocol", [2, 4])
def test_images_stored_as_numpy_arrays(tmp_path, protocol):
    # protocol 2 stores the arrays' bytes through _codecs.encode, protocol 4 directly
    path = tmp_path / "cfp_fp.bin"
    arrays = [np.frombuffer(b, np.uint8) for b in IMAGES]
    path.write_bytes(pickle.dumps((arrays, [np.bool_(v) for v in ISSAME]), protocol=protocol))
    write_bin(tmp_path / "ref.bin", IMAGES, ISSAME)
    got, ref = read_bin(path), read_bin(tmp_path / "ref.bin")
    assert np.array_equal(got.images, ref.images) and got.issame.tolist() == ISSAME


def test_python2_pickle(tmp_path):
    """What Python 2's cPickle wrote for lfw.bin: byte strings as BINSTRING, protocol 2."""
    def items(values: list[bytes]) -> bytes:
        return b"".join(b"T" + struct.pack("<i", len(v)) + v for v in values)

    data = (b"\x80\x02" + b"](" + items(IMAGES) + b"e"
            + b"](" + b"".join(b"\x88" if v else b"\x89" for v in ISSAME) + b"e"
            + b"\x86.")
    path = tmp_path / "agedb_30.bin"
    path.write_bytes(data)
    got = read_bin(path)
    assert got.images.shape == (6, 12, 12, 3) and got.issame.tolist() == ISSAME


def test_mixed_sizes_need_a_size(tmp_path):
    path = tmp_path / "mixed.bin"
    write_bin(path, IMAGES[:5] + [jpeg(9, 16, 10)], ISSAME)
    with pytest.raises(VerificationSetError, match=r"image 6 is 16x10 but image 1 is 12x12"):
        read_bin(path)
    assert read_bin(path, size=12).images.shape == (6, 12, 12, 3)


class _Shell:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _Eval:
    def __reduce__(self):
        return eval, ("1 + 1",)


def _bad_files(tmp_path) -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, what the message must say)."""
    good = pickle.dumps((IMAGES, ISSAME), protocol=4)
    marker = tmp_path / "ran"
    return {
        "random": (np.random.default_rng(0).bytes(300), "not a pickled verification set"),
        "truncated": (good[:len(good) // 2], "truncated"),
        "dict": (pickle.dumps({"bins": IMAGES}), r"expected a pickled \(images, issame\) pair"),
        "triple": (pickle.dumps((IMAGES, ISSAME, [])), "got a 3-tuple"),
        "issame-str": (pickle.dumps((IMAGES, "yes")), "issame must be a list"),
        "count": (pickle.dumps((IMAGES[:5], ISSAME)), "5 images for 3 pairs"),
        "empty": (pickle.dumps(([], [])), "holds no pairs"),
        "flag": (pickle.dumps((IMAGES, [True, "no", False])),
                 "issame entry 2 of 3 is not a bool"),
        "text": (pickle.dumps((IMAGES[:3] + [b"hello, world"] + IMAGES[4:], ISSAME)),
                 r"image 4 of 6 is not an image \(12 bytes"),
        "number": (pickle.dumps((IMAGES[:5] + [7], ISSAME)), r"image 6 of 6 is not an image"),
        "broken": (pickle.dumps((IMAGES[:1] + [b"\xff\xd8\xff" + bytes(40)] + IMAGES[2:],
                                 ISSAME)), r"image 2 of 6 is not an image \(undecodable"),
        "shell": (pickle.dumps((IMAGES, ISSAME, _Shell(f"touch {marker}"))),
                  r"refused to load (posix|os|nt)\.system"),
        "eval": (pickle.dumps(_Eval()), r"refused to load builtins\.eval"),
    }


def test_bad_files_name_themselves(tmp_path):
    for name, (data, words) in _bad_files(tmp_path).items():
        path = tmp_path / f"{name}.bin"
        path.write_bytes(data)
        with pytest.raises(VerificationSetError, match=words) as info:
            read_bin(path)
        message = str(info.value)
        assert message.startswith(f"{path}: ") and "\n" not in message, name
    assert not (tmp_path / "ran").exists()  # the pickled os.system never ran
    with pytest.raises(VerificationSetError, match=r"missing\.bin: cannot read"):
        read_bin(tmp_path / "missing.bin")


def test_write_refuses_mismatches_and_leaves_nothing(tmp_path):
    path = tmp_path / "x.bin"
    with pytest.raises(VerificationSetError, match="5 images for 3 pairs"):
        write_bin(path, IMAGES[:5], ISSAME)
    with pytest.raises(VerificationSetError, match="image 2 of 6 is a str"):
        write_bin(path, [IMAGES[0], "text"] + IMAGES[2:], ISSAME)
    assert list(tmp_path.iterdir()) == []


# --- evaluation against a plain-Python reference ----------------------------------------------

def reference(embeddings: list[list[float]], issame: list[bool], folds: int,
              far_targets: list[float]) -> list[dict]:
    """insightface's protocol written out with loops, one threshold and one pair at a time;
    one result per FAR target."""
    def unit(v):
        n = math.sqrt(sum(a * a for a in v))
        return [a / n for a in v]

    dist = [sum((a - b) ** 2 for a, b in zip(unit(embeddings[2 * i]),
                                               unit(embeddings[2 * i + 1])))
            for i in range(len(issame))]
    thresholds = [i * 0.01 for i in range(400)]
    sizes = [len(issame) // folds + (1 if k < len(issame) % folds else 0) for k in range(folds)]
    starts = [sum(sizes[:k]) for k in range(folds)]

    def rates(pairs, threshold):
        ta = fa = same = diff = correct = 0
        for i in pairs:
            accept = dist[i] < threshold
            same += issame[i]
            diff += not issame[i]
            ta += accept and issame[i]
            fa += accept and not issame[i]
            correct += accept == issame[i]
        return (correct / len(pairs), ta / same if same else 0.0, fa / diff if diff else 0.0)

    accs, bests = [], []
    tars = {t: [] for t in far_targets}
    fars = {t: [] for t in far_targets}
    for k in range(folds):
        test = list(range(starts[k], starts[k] + sizes[k]))
        train = [i for i in range(len(issame)) if i not in test]
        curve = [rates(train, t) for t in thresholds]
        best_acc, best = -1.0, 0.0
        for t, (acc, _, _) in zip(thresholds, curve):
            if acc > best_acc:  # strictly: ties keep the lower threshold
                best_acc, best = acc, t
        bests.append(best)
        accs.append(rates(test, best)[0])
        far_curve = [far for _, _, far in curve]
        for target in far_targets:
            if max(far_curve) >= target:
                # the last threshold whose FAR is at most the target, then on to the next step
                j = max(i for i, f in enumerate(far_curve) if f <= target)
                if far_curve[j] == target:
                    threshold = thresholds[j]
                else:
                    share = (target - far_curve[j]) / (far_curve[j + 1] - far_curve[j])
                    threshold = thresholds[j] + share * (thresholds[j + 1] - thresholds[j])
            else:
                threshold = 0.0
            _, tar, far = rates(test, threshold)
            tars[target].append(tar)
            fars[target].append(far)

    def mean(xs):
        return sum(xs) / len(xs)

    def std(xs):
        return math.sqrt(mean([(x - mean(xs)) ** 2 for x in xs]))

    return [{"accuracy": mean(accs), "accuracy_std": std(accs), "best_thresholds": bests,
             "tar": mean(tars[t]), "tar_std": std(tars[t]), "far": mean(fars[t])}
            for t in far_targets]


def hand_built(pairs: int, seed: int) -> tuple[list[list[float]], list[bool]]:
    """Same pairs a noisy copy (sometimes very noisy: ambiguous), different pairs independent;
    norms vary, so normalisation matters. The first and last different pairs are exactly
    opposite (distance 4, beyond every threshold), so every fold's training pairs hold one and
    their FAR never reaches 1."""
    rng = np.random.default_rng(seed)
    opposite = {1, pairs - 1 if (pairs - 1) % 2 else pairs - 2}
    emb, same = [], []
    for i in range(pairs):
        a = rng.standard_normal(4)
        if i in opposite:
            b = -a
        elif i % 2 == 0:
            b = a + (0.9 if i % 6 == 0 else 0.3) * rng.standard_normal(4)
        else:
            b = rng.standard_normal(4)
        emb += [list(a * rng.uniform(0.5, 3)), list(b * rng.uniform(0.5, 3))]
        same.append(i % 2 == 0)
    return emb, same


@pytest.mark.parametrize("pairs", [40, 43])
def test_evaluate_matches_a_plain_reference(pairs):
    emb, same = hand_built(pairs, seed=pairs + 1)
    targets = [1e-3, 0.1, 0.25, 1 / 3, 1.0]
    for target, want in zip(targets, reference(emb, same, 10, targets)):
        got = evaluate(np.array(emb), np.array(same), folds=10, far_target=target)
        assert (got["pairs"], got["folds"], got["far_target"]) == (pairs, 10, target)
        for key in ("accuracy", "accuracy_std", "tar", "tar_std", "far"):
            assert got[key] == pytest.approx(want[key], abs=1e-12), (target, key)
        assert got["best_thresholds"] == pytest.approx(want["best_thresholds"], abs=1e-12)
    assert len(set(got["best_thresholds"])) > 1  # ambiguous pairs move the fold thresholds
    assert 0.5 < got["accuracy"] < 1 and got["accuracy_std"] > 0
    # FAR 1 is out of reach, so the threshold is 0, which accepts nothing
    assert got["tar"] == got["far"] == 0.0


def test_evaluate_checks_its_inputs():
    emb, same = hand_built(20, seed=1)
    x, y = np.array(emb), np.array(same)
    cases = [(x[:-1], y, {}, r"\[2N, D\] = \[40, D\]"),
             (x, y.astype(int), {}, "1-D bool"),
             (x, y, {"folds": 21}, "20 pairs cannot fill 21 folds"),
             (x, y, {"folds": 1}, "at least 2"),
             (x, np.ones(20, bool), {}, "both same and different"),
             (np.where(np.arange(40)[:, None] == 3, np.nan, x), y, {}, "NaN"),
             (x, y, {"far_target": 0.0}, r"far_target must be in \(0, 1\]")]
    for emb_, same_, kwargs, words in cases:
        with pytest.raises(ValueError, match=words):
            evaluate(emb_, same_, **kwargs)


def test_format_table():
    emb, same = hand_built(40, seed=40)
    r = evaluate(np.array(emb), np.array(same))
    lines = format_table({"lfw": r}).splitlines()
    assert lines[0] == "| set | pairs | accuracy (%) | TAR @ FAR=0.001 (%) |"
    assert lines[2] == (f"| lfw | 40 | {100 * r['accuracy']:.2f} ± "
                        f"{100 * r['accuracy_std']:.2f} | {100 * r['tar']:.2f} ± "
                        f"{100 * r['tar_std']:.2f} |")


# --- the synthetic held-out set --------------------------------------------------------------

def _decoded(images: np.ndarray) -> np.ndarray:
    return images.reshape(len(images), -1).astype(np.float64)


def test_synth_val_set(tmp_path):
    small = {"identities": 6, "images_per_identity": 4, "size": 32, "seed": 5}
    plain = synthesize(tmp_path / "plain", **small)
    assert plain["val_bin"] is None and plain["val_pairs"] == 0
    assert not (tmp_path / "plain.val.bin").exists()
    done = synthesize(tmp_path / "a", **small, val_pairs=24)
    synthesize(tmp_path / "b", **small, val_pairs=24)
    # the val options leave the training records as they were, byte for byte
    for ext in ("rec", "idx"):
        assert (tmp_path / f"a.{ext}").read_bytes() == (tmp_path / f"plain.{ext}").read_bytes()
    assert (tmp_path / "a.val.bin").read_bytes() == (tmp_path / "b.val.bin").read_bytes()
    assert done["val_bin"] == str(tmp_path / "a.val.bin") and done["val_pairs"] == 24

    val = read_bin(done["val_bin"])
    assert val.images.shape == (48, 32, 32, 3) and val.issame.sum() == 12
    assert 0 < val.issame[:12].sum() < 12  # shuffled, not all same pairs first

    # Held-out identities. The default nuisance hides identities from raw pixels, so they
    # are compared without it: every image of an identity is then its one drawing, the same
    # pairs are pixel-identical, and no val image is a training identity's drawing, all
    # being as far from those as two training identities are from each other (measured:
    # 853 at the closest, against 941 between training identities, 895 in a different pair).
    drawn = synthesize(tmp_path / "p", **small, val_pairs=24, nuisance=0)
    ds = open_dataset(drawn["prefix"])
    from trainperf.data.decode import get_decoder

    decode = get_decoder("auto")
    drawings = _decoded(np.stack([decode(ds.reader.read_image(k)[1])
                                  for k in ds.image_keys]))[::4]
    between = np.sqrt(((drawings[:, None] - drawings[None]) ** 2).sum(-1))
    closest_training = between[~np.eye(6, dtype=bool)].min()
    val = read_bin(drawn["val_bin"])
    to_val = np.sqrt(((_decoded(val.images)[:, None] - drawings[None]) ** 2).sum(-1))
    assert to_val.min() > 0.5 * closest_training
    first, second = _decoded(val.images[0::2]), _decoded(val.images[1::2])
    pair_dist = np.sqrt(((first - second) ** 2).sum(1))
    assert (pair_dist[val.issame] == 0).all()
    assert pair_dist[~val.issame].min() > 0.5 * closest_training


def test_synth_val_arguments_and_cli(tmp_path, capsys):
    for kwargs in ({"val_pairs": -1}, {"val_pairs": 10, "val_identities": 1}):
        with pytest.raises(ValueError):
            synthesize(tmp_path / "s", identities=2, images_per_identity=2, size=16, **kwargs)
    assert main(["data", "synth", "--identities", "2", "--images-per-identity", "2",
                 "--size", "16", "--val-pairs", "10", "--out", str(tmp_path / "c")]) == 0
    assert f"10 verification pairs of held-out identities to {tmp_path / 'c.val.bin'}" in \
        capsys.readouterr().out
    assert read_bin(tmp_path / "c.val.bin").pairs == 10
