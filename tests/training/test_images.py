"""training/images.py: limits from the header, the decode policy, fit_square geometry."""

import io
import time

import image_files as F
import numpy as np
import pytest
from PIL import Image, ImageFile

from training.images import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_PIXELS,
    ImageError,
    ImageLimits,
    cache_resolution,
    fit_square,
    load_rgb,
    load_square,
    open_checked,
    to_rgb_array,
)


@pytest.fixture
def no_decode(monkeypatch):
    """Fail the test if any pixel data is decoded."""

    def refuse(self, *a, **k):
        raise AssertionError(f"pixel data of a {self.size} image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)


def test_default_pixel_limit_is_the_apis():
    from api.config import Settings

    assert DEFAULT_LIMITS.max_pixels == DEFAULT_MAX_PIXELS == Settings().max_image_pixels == 20_000_000


def test_huge_png_refused_from_the_header_without_decoding(tmp_path, no_decode):
    path = F.huge_png(tmp_path / "huge.png")
    assert path.stat().st_size < 1 << 20  # a real 600 MP PNG in well under a megabyte
    assert path.read_bytes()[16:24] == (F.HUGE_SIDE).to_bytes(4, "big") * 2  # IHDR width, height
    t0 = time.perf_counter()
    with pytest.raises(ImageError) as err:
        load_square(path, 64)
    assert time.perf_counter() - t0 < 1.0
    assert err.value.code == "image_too_large"
    assert "600250000 pixels" in str(err.value) and "limit is 20000000" in str(err.value)
    # between our limit and PIL's hard limit (2 x 89 MP) the header check answers, with the size
    mid = F.huge_png(tmp_path / "mid.png", side=5000)
    with pytest.raises(ImageError, match="5000x5000 = 25000000 pixels") as err:
        load_rgb(mid)
    assert err.value.code == "image_too_large"


def test_pixel_limit_is_inclusive_and_bytes_limit(tmp_path):
    path = F.save(tmp_path / "a.png", Image.new("RGB", (10, 10), (1, 2, 3)))
    assert load_rgb(path, ImageLimits(max_pixels=100)).shape == (10, 10, 3)
    with pytest.raises(ImageError, match="10x10 = 100 pixels") as err:
        load_rgb(path, ImageLimits(max_pixels=99))
    assert err.value.code == "image_too_large"
    size = path.stat().st_size
    assert load_rgb(path, ImageLimits(max_bytes=size)).shape == (10, 10, 3)
    with pytest.raises(ImageError, match=f"{size} bytes") as err:
        load_rgb(path, ImageLimits(max_bytes=size - 1))
    assert err.value.code == "file_too_large"
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)


@pytest.mark.parametrize(
    "make, code",
    [
        (F.text_png, "not_an_image"),
        (F.truncated_png, "corrupt_image"),
        (lambda p: (p.write_bytes(b""), p)[1], "empty_file"),
        (lambda p: p, "unreadable"),  # does not exist
    ],
)
def test_bad_files_have_one_reason_each(tmp_path, make, code):
    path = make(tmp_path / "x.png")
    with pytest.raises(ImageError) as err:
        load_square(path, 16)
    assert err.value.code == code and str(tmp_path / "x.png") in str(err.value)
    assert err.value.to_dict() == {"reason": code, "error": str(err.value)}


def test_truncated_jpeg_and_bytes_source(tmp_path):
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, "JPEG")
    raw = buf.getvalue()
    with pytest.raises(ImageError) as err:
        load_rgb(raw[: len(raw) // 2])
    assert err.value.code == "corrupt_image" and "upload" in str(err.value)
    path = tmp_path / "ok.jpg"
    path.write_bytes(raw)
    np.testing.assert_array_equal(load_rgb(raw), load_rgb(path))
    np.testing.assert_array_equal(load_square(raw, 16), load_square(path, 16))


def test_palette_transparency_composited_onto_white(tmp_path):
    path, expected = F.rgba_palette_png(tmp_path / "p.png")
    with Image.open(path) as im:
        assert im.mode == "P" and "transparency" in im.info
    np.testing.assert_array_equal(load_rgb(path), expected)


def test_rgba_and_la_onto_white_match_the_blend_formula(tmp_path):
    rng = np.random.default_rng(1)
    rgba = rng.integers(0, 256, (7, 9, 4), dtype=np.uint8)
    la = rng.integers(0, 256, (7, 9, 2), dtype=np.uint8)
    a = rgba[..., 3:].astype(np.int64)
    ref = ((rgba[..., :3].astype(np.int64) * a + 255 * (255 - a) + 127) // 255).astype(np.uint8)
    got = load_rgb(F.save(tmp_path / "rgba.png", Image.fromarray(rgba, mode="RGBA")))
    np.testing.assert_allclose(got.astype(int), ref.astype(int), atol=1)
    al = la[..., 1:].astype(np.int64)
    ref_la = ((la[..., :1].astype(np.int64) * al + 255 * (255 - al) + 127) // 255).astype(np.uint8)
    got_la = load_rgb(F.save(tmp_path / "la.png", Image.fromarray(la, mode="LA")))
    np.testing.assert_allclose(got_la.astype(int), np.repeat(ref_la, 3, axis=2).astype(int), atol=1)
    # a fully transparent pixel is white whatever its colour; an opaque one keeps its colour
    rgba[0, 0] = (10, 20, 30, 0)
    rgba[0, 1] = (10, 20, 30, 255)
    got = load_rgb(F.save(tmp_path / "rgba2.png", Image.fromarray(rgba, mode="RGBA")))
    assert tuple(got[0, 0]) == (255, 255, 255) and tuple(got[0, 1]) == (10, 20, 30)


def test_sixteen_bit_scaled_not_clipped(tmp_path):
    path, expected = F.sixteen_bit_grey_png(tmp_path / "g16.png")
    got = load_rgb(path)
    np.testing.assert_array_equal(got[..., 0], expected)
    np.testing.assert_array_equal(got[..., 0], got[..., 2])
    path, expected = F.sixteen_bit_rgb_png(tmp_path / "rgb16.png")
    np.testing.assert_allclose(load_rgb(path).astype(int), expected.astype(int), atol=1)


def test_cmyk_jpeg_and_exif_orientation(tmp_path):
    path, expected = F.cmyk_jpeg(tmp_path / "cmyk.jpg")
    with Image.open(path) as im:
        assert im.mode == "CMYK"
    np.testing.assert_allclose(load_rgb(path).astype(int), expected.astype(int), atol=12)
    path, expected = F.exif_rotated_jpeg(tmp_path / "rot.jpg")
    got = load_rgb(path)
    assert got.shape == (32, 16, 3)
    np.testing.assert_allclose(got.astype(int), expected.astype(int), atol=40)
    assert got[:14].mean() > 240 and got[18:].mean() < 15  # white on top once displayed


def test_animated_gif_first_frame(tmp_path):
    got = load_rgb(F.animated_gif(tmp_path / "a.gif"))
    assert got.shape == (10, 10, 3) and tuple(got[5, 5]) == (255, 0, 0)


def test_jpeg_draft_decodes_at_reduced_scale(tmp_path):
    rng = np.random.default_rng(2)
    smooth = np.kron(rng.integers(0, 256, (6, 8, 3)), np.ones((128, 128, 1))).astype(np.uint8)  # 768 x 1024
    path = F.save(tmp_path / "big.jpg", Image.fromarray(smooth), quality=95)
    assert load_rgb(path).shape == (768, 1024, 3)
    # coarsest DCT scale keeping both sides >= 64: min(1024 // 64, 768 // 64) = 12 -> 1/8
    assert load_rgb(path, min_side=64).shape == (96, 128, 3)
    assert load_rgb(path, min_side=200).shape == (384, 512, 3)  # 768 // 200 = 3 -> 1/2
    # the drafted square is close to the full decode's square (smooth content)
    full = fit_square(load_rgb(path), 64).astype(int)
    np.testing.assert_allclose(load_square(path, 64).astype(int), full, atol=64)  # differ only at edges
    assert np.abs(load_square(path, 64).astype(int) - full).mean() < 3


def test_fit_square_geometry_matches_preprocess():
    from training.transforms import denormalize, preprocess

    wide = np.zeros((10, 20, 3), np.uint8)
    wide[:, 5:15] = 255  # the central square is white
    np.testing.assert_array_equal(fit_square(wide, 10), np.full((10, 10, 3), 255, np.uint8))
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (40, 60, 3), dtype=np.uint8)
    sq = fit_square(img, 20)
    assert sq.shape == (20, 20, 3) and sq.dtype == np.uint8
    # same crop + resize as the torch path, up to resampling and rounding differences
    ref = denormalize(preprocess(img[None], 20))[0].astype(int)
    assert np.abs(sq.astype(int) - ref).mean() < 4
    np.testing.assert_array_equal(fit_square(img[:20, :20], 20), img[:20, :20])
    with pytest.raises(ValueError, match="side"):
        fit_square(img, 0)
    assert cache_resolution(32) == 64


def test_to_rgb_array_modes():
    assert to_rgb_array(Image.new("1", (3, 2), 1)).tolist() == np.full((2, 3, 3), 255).tolist()
    f = Image.fromarray(np.array([[0.0, 0.5, 1.0]], np.float32), mode="F")
    assert to_rgb_array(f)[0, :, 0].tolist() == [0, 128, 255]
    ycc = Image.new("RGB", (2, 2), (200, 100, 50)).convert("YCbCr")
    np.testing.assert_allclose(to_rgb_array(ycc).astype(int), np.full((2, 2, 3), (200, 100, 50)), atol=2)
    with pytest.raises(ValueError, match="PIL"):
        to_rgb_array("nope")


def test_open_checked_is_lazy(tmp_path, no_decode):
    path = F.save(tmp_path / "a.png", Image.new("RGB", (30, 20)))
    with open_checked(path) as im:
        assert im.size == (30, 20)
