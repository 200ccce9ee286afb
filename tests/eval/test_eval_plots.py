import math

import numpy as np
import pytest

from sparse_rl.eval.plots import difference_map, heatmap, line_plot


def _read_png(path):
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return imread(str(path))


def _cell_colours(img, info, rows, cols):
    """Colour near the top-left corner of each cell (away from the centred value label)."""
    x0, y0, x1, y1 = info.axes_px
    out = np.zeros((rows, cols, 3))
    for i in range(rows):
        for j in range(cols):
            x = int(x0 + (j + 0.15) * (x1 - x0) / cols)
            y = int(y0 + (i + 0.15) * (y1 - y0) / rows)
            out[i, j] = img[y, x, :3]
    return out


def test_heatmap_pixels_match_the_grid(tmp_path):
    from matplotlib import colormaps

    m = [[0.0, 0.25, 0.5, 1.0], [0.1, None, 0.7, 0.9], [1.0, 0.8, 0.3, 0.05]]
    info = heatmap(m, ["0", "0.5", "1"], [512, 1024, 2048, 4096], tmp_path / "h.png", title="t")
    img = _read_png(info.path)
    assert img.shape[:2] == (info.size_px[1], info.size_px[0])
    assert np.array(info.data).shape == (3, 4)
    got = _cell_colours(img, info, 3, 4)
    cmap = colormaps["RdYlGn"]
    for i in range(3):
        for j in range(4):
            want = (0.741, 0.741, 0.741) if m[i][j] is None else cmap(m[i][j])[:3]  # missing -> grey
            assert np.allclose(got[i, j], want, atol=2.5 / 255), (i, j, got[i, j], want)


def test_difference_map_is_b_minus_a_centred(tmp_path):
    from matplotlib import colormaps

    a = [[1.0, 0.5], [0.0, 1.0]]
    b = [[1.0, 1.0], [0.0, 0.0]]
    info = difference_map(a, b, ["r0", "r1"], ["c0", "c1"], tmp_path / "d.png", name_a="dense", name_b="sparse")
    assert info.data == [[0.0, 0.5], [0.0, -1.0]]
    got = _cell_colours(_read_png(info.path), info, 2, 2)
    cmap = colormaps["RdBu"]
    assert np.allclose(got[1, 1], cmap(0.0)[:3], atol=2.5 / 255)   # -1 at the bottom of [-1, 1]
    assert np.allclose(got[0, 1], cmap(0.75)[:3], atol=2.5 / 255)  # +0.5


def test_heatmap_rejects_mismatched_labels(tmp_path):
    with pytest.raises(ValueError, match="does not match"):
        heatmap([[1.0, 2.0]], ["a"], ["x"], tmp_path / "h.png")
    assert not (tmp_path / "h.png").exists()


def test_line_plot(tmp_path):
    p = line_plot([1, 2, 4, 8], {"kl": [0.1, 0.2, 0.3, math.nan], "other": [1, 1, 1, 1]}, tmp_path / "l.png",
                  logx=True, ylabel="KL")
    img = _read_png(p)
    assert img.shape[0] > 100 and img.std() > 0
    with pytest.raises(ValueError):
        line_plot([1, 2], {"kl": [1.0]}, tmp_path / "bad.png")


def test_plots_follow_the_umask(tmp_path):
    """A PNG is created like any other output file (0666 less the umask), not mkstemp's 0600."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        p = line_plot([1, 2], {"kl": [0.1, 0.2]}, tmp_path / "m.png")
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o644
