// Tensors as raw bits: { dtype, shape, data }, data a typed array of the
// dtype's bits (uint32 and float32 as Uint32Array, float16 and bfloat16 as
// Uint16Array, int32 as Int32Array, bool as Uint8Array), C-contiguous.

export const BITS_OF = {
  uint32: Uint32Array, int32: Int32Array, float32: Uint32Array, float16: Uint16Array, bfloat16: Uint16Array,
  bool: Uint8Array, uint8: Uint8Array,
};

export function size(shape) {
  return shape.reduce((a, b) => a * b, 1);
}

export function tensor(dtype, shape, data) {
  const Bits = BITS_OF[dtype];
  if (!Bits) throw new Error(`dtype ${dtype} is not supported`);
  data = data || new Bits(size(shape));
  if (data.length !== size(shape)) throw new Error(`${data.length} elements for shape [${shape}]`);
  return { dtype, shape: [...shape], data };
}

// A copy of `src` rows `rows` (axis 0) of a [B, H, T, W] tensor, columns [start, stop) of axis 2,
// placed at column `at` of a new tensor `width` columns wide (zeros elsewhere).
export function place(src, rows, start, stop, width, at) {
  const [, H, T, W] = src.shape;
  const out = tensor(src.dtype, [rows.length, H, width, W]);
  const count = (stop - start) * W;
  rows.forEach((row, b) => {
    for (let h = 0; h < H; h++) {
      const from = ((row * H + h) * T + start) * W;
      const to = ((b * H + h) * width + at) * W;
      out.data.set(src.data.subarray(from, from + count), to);
    }
  });
  return out;
}

// Several [1 or more, H, T_i, W] tensors of one width T stacked on axis 0.
export function stack(parts) {
  const [, H, T, W] = parts[0].shape;
  const B = parts.reduce((n, p) => n + p.shape[0], 0);
  const out = tensor(parts[0].dtype, [B, H, T, W]);
  let at = 0;
  for (const p of parts) {
    out.data.set(p.data, at);
    at += p.data.length;
  }
  return out;
}

// Row b of [B, H, T, W] moved right by `shift` columns inside the width, the vacated columns zeroed.
export function shiftRow(t, b, shift) {
  const [, H, T, W] = t.shape;
  for (let h = 0; h < H; h++) {
    const base = (b * H + h) * T * W;
    t.data.copyWithin(base + shift * W, base, base + (T - shift) * W);
    t.data.fill(0, base, base + shift * W);
  }
}

export function equalBits(a, b) {
  if (a.dtype !== b.dtype || a.shape.length !== b.shape.length || a.shape.some((n, i) => n !== b.shape[i])) return false;
  for (let i = 0; i < a.data.length; i++) if (a.data[i] !== b.data[i]) return false;
  return true;
}

// The first flat index where two tensors of one shape differ, or -1.
export function firstDifference(a, b) {
  for (let i = 0; i < a.data.length; i++) if (a.data[i] !== b.data[i]) return i;
  return -1;
}
