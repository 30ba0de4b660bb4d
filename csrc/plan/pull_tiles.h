// The geometry of the pull grad_value path (cuda/backward/pull_grad_value.cu),
// pure functions of the level shapes shared by its kernels and the tests:
// a level's tile shape, a query's own cell on another level, and the query
// rows (columns) whose own cell lies within kPullRadius of a tile.
//
// An encoder's queries are the pixels of its levels, and a sample lands near
// its query's position mapped to the sampled level. A sample is "home" when
// its cell (h0 + 1, w0 + 1) lies within kPullRadius cells (Chebyshev) of its
// query's own cell there, shifted by one like the cell; a tile then finds
// every home sample that touches it among the queries of one rectangle a
// query level, and every other sample (an escape) in a bucket.
#pragma once

#include <cstdint>

#include "../core/params.h"
#include "../core/sampling.h"
#include "launch_shapes.h"

namespace msda::pull {

// floor(a / b) for b > 0.
MSDA_HD int64_t floor_div(int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Query row y of a level of Hq rows: its own pixel row on a level of Hl rows,
// floor((y + 0.5) Hl / Hq - 0.5) (-1 where its centre lies above row 0's).
MSDA_HD int own_row(int y, int Hl, int Hq) {
  return int(floor_div((2 * int64_t(y) + 1) * Hl - Hq, 2 * int64_t(Hq)));
}

// The first query row y in [0, Hq] whose own row on level Hl exceeds v
// (own_row grows with y): the least y with (2 y + 1) Hl - Hq >= 2 Hq (v + 1).
MSDA_HD int first_row_above(int64_t v, int Hl, int Hq) {
  const int64_t num = (2 * v + 3) * Hq - Hl, den = 2 * int64_t(Hl);
  const int64_t y = -floor_div(-num, den);  // ceil(num / den)
  return int(y < 0 ? 0 : (y > Hq ? Hq : y));
}

// Query rows [*a, *b) of a level of Hq rows whose own row on level Hl lies in
// [lo, hi]: the window of a tile's cell rows (r0 .. r0 + th, own rows
// r0 - 1 - R .. r0 + th - 1 + R).
MSDA_HD void window_rows(int64_t lo, int64_t hi, int Hl, int Hq, int* a, int* b) {
  *a = first_row_above(lo - 1, Hl, Hq);
  *b = first_row_above(hi, Hl, Hq);
  if (*a > *b) *a = *b;
}

// Whether a sample whose cell is (h, w) (h0 + 1, w0 + 1) and whose query's own
// cell is (cy, cx) (own_row of its row and column) is home.
MSDA_HD bool home(int h, int w, int cy, int cx) {
  const int dy = h - 1 - cy, dx = w - 1 - cx;
  return dy <= cuda::kPullRadius && -dy <= cuda::kPullRadius && dx <= cuda::kPullRadius &&
         -dx <= cuda::kPullRadius;
}

// A level's tile (th x tw pixels, the last row and column of tiles clipped):
// of the shapes 4..64 x 4..64 (powers of two, clipped to the level) with at
// most kPullTilePixels pixels, the one whose windows read the fewest
// candidates, by the unclipped estimate (H + ty (2 R + 2)) (W + tx (2 R + 2))
// for ty x tx tiles (a tile's window spans th + 2 R + 2 own rows); the
// first of equals.
struct TileShape {
  int th, tw;
};
MSDA_HD TileShape tile_shape(int H, int W) {
  TileShape best{H < 16 ? H : 16, W < 16 ? W : 16};
  double cost = -1;
  const int margin = 2 * cuda::kPullRadius + 2;
  for (int i = 2; i <= 6; ++i) {
    const int th0 = 1 << i, th = th0 < H ? th0 : H;
    if (th0 > H && th0 / 2 >= H) continue;  // the same clipped shape as a smaller th0
    for (int j = 2; j <= 6; ++j) {
      const int tw0 = 1 << j, tw = tw0 < W ? tw0 : W;
      if (tw0 > W && tw0 / 2 >= W) continue;
      if (int64_t(th) * tw > cuda::kPullTilePixels) continue;
      const int64_t ty = (H + th - 1) / th, tx = (W + tw - 1) / tw;
      const double c = double(H + ty * margin) * double(W + tx * margin);
      if (cost < 0 || c < cost) {
        cost = c;
        best = TileShape{th, tw};
      }
    }
  }
  return best;
}

// Tiles of a level: ceil(H / th) x ceil(W / tw).
MSDA_HD int64_t tile_count(int H, int W) {
  const TileShape t = tile_shape(H, W);
  return int64_t((H + t.th - 1) / t.th) * ((W + t.tw - 1) / t.tw);
}

// The tile whose bucket holds an escape with cell (h, w) on a level (its
// pixel (h - 1, w - 1), clamped to the map): the cell touches that tile and
// at most the ones right of, below and right below it.
MSDA_HD int64_t home_tile(int h, int w, int H, int W, TileShape t) {
  const int py = h >= 1 ? h - 1 : 0, px = w >= 1 ? w - 1 : 0;
  const int tiles_x = (W + t.tw - 1) / t.tw;
  (void)H;
  return int64_t(py / t.th) * tiles_x + px / t.tw;
}

}  // namespace msda::pull
