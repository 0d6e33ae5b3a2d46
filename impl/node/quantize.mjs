// MLX's affine quantization (mx.quantize), bit for bit, without MLX.
//
// Per group of `groupSize` values along the last axis, in float32 as MLX's
// CPU kernel computes it: the group's min and max; scale = (max - min) /
// (2^bits - 1), at least 1e-7, signed toward the edge of larger magnitude;
// that edge is made exactly representable (scale = edge / rint(edge / scale),
// bias = edge) unless it rounds to 0 (bias 0); each value is
// rint((w - bias) / scale) clamped to [0, 2^bits - 1]. rint rounds half to
// even. Codes are packed little-endian: for bits 2, 4, 8, 32 / bits codes
// per uint32; for 3, 5, 6, a run of 8, 8, 4 codes fills 3, 5, 3 bytes, and
// the byte stream is read as uint32 words. Either way every pack is whole
// bytes, so the codes are one little-endian bit stream. Scales and biases are float32
// rounded to the input's dtype (round to nearest, ties to even).
//
// Arrays hold raw bits: float16 and bfloat16 as Uint16Array, float32 as
// Uint32Array, packed codes as Uint32Array.

export const SUPPORTED_BITS = [2, 3, 4, 5, 6, 8];
export const SUPPORTED_DTYPES = ['bfloat16', 'float16', 'float32'];

const f32 = new Float32Array(1);
const u32 = new Uint32Array(f32.buffer);

export function f32FromBits(bits) {
  u32[0] = bits;
  return f32[0];
}

export function bitsFromF32(x) {
  f32[0] = x;
  return u32[0];
}

export function bf16ToF32(h) {
  return f32FromBits((h & 0xffff) << 16);
}

export function f32ToBf16(x) {
  const bits = bitsFromF32(x);
  if ((bits & 0x7fffffff) > 0x7f800000) return ((bits >>> 16) | 0x40) & 0xffff; // NaN stays a (quiet) NaN
  const rounded = bits + 0x7fff + ((bits >>> 16) & 1);
  return (rounded >>> 16) & 0xffff;
}

export function f16ToF32(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exponent = (h >>> 10) & 0x1f;
  const fraction = h & 0x3ff;
  if (exponent === 0) return sign * fraction * 2 ** -24;
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
}

export function f32ToF16(x) {
  const bits = bitsFromF32(x);
  const sign = (bits >>> 16) & 0x8000;
  const exponent = (bits >>> 23) & 0xff;
  const mantissa = bits & 0x7fffff;
  if (exponent === 0xff) return sign | 0x7c00 | (mantissa ? 0x200 : 0);
  const e = exponent - 127 + 15;
  if (e >= 31) return sign | 0x7c00; // overflow: infinity
  if (e <= 0) {
    // A subnormal half (or zero): the value in units of 2^-24, rounded half to even.
    if (e < -10) return sign;
    const full = mantissa | 0x800000;
    const shift = 14 - e;
    let half = full >>> shift;
    const rest = full & ((1 << shift) - 1);
    const midpoint = 1 << (shift - 1);
    if (rest > midpoint || (rest === midpoint && (half & 1))) half += 1;
    return sign | half;
  }
  let half = (e << 10) | (mantissa >>> 13);
  const rest = mantissa & 0x1fff;
  if (rest > 0x1000 || (rest === 0x1000 && (half & 1))) half += 1; // a carry into the exponent is right
  return sign | half;
}

// dtype -> [read value from bits, write bits from float32 value, typed array of bits, bytes]
export const DTYPES = {
  bfloat16: [bf16ToF32, f32ToBf16, Uint16Array, 2],
  float16: [f16ToF32, f32ToF16, Uint16Array, 2],
  float32: [f32FromBits, bitsFromF32, Uint32Array, 4],
};

// Round half to even, as C's rint in the default rounding mode.
export function rint(x) {
  const floor = Math.floor(x);
  const rest = x - floor;
  if (rest < 0.5) return floor;
  if (rest > 0.5) return floor + 1;
  return floor % 2 === 0 ? floor : floor + 1;
}

// Words of uint32 per group, and codes per pack and bytes per pack.
export function packing(bits) {
  if (!SUPPORTED_BITS.includes(bits)) throw new Error(`bits=${bits} is not supported (choose from ${SUPPORTED_BITS})`);
  const perPack = bits === 3 || bits === 5 ? 8 : bits === 6 ? 4 : 32 / bits;
  const bytesPerPack = bits === 3 || bits === 6 ? 3 : bits === 5 ? 5 : 4;
  return { perPack, bytesPerPack };
}

// Quantize `count` rows of `dim` values each (bits of `dtype`, row after row).
// Returns { packed: Uint32Array(count * dim * bits / 32), scales, biases: bits of dtype, count * dim / groupSize }.
export function quantize(values, dtype, count, dim, groupSize, bits) {
  const [read, write, Bits] = DTYPES[dtype] || [];
  if (!read) throw new Error(`dtype ${dtype} is not supported (choose from ${SUPPORTED_DTYPES})`);
  if (dim % groupSize) throw new Error(`group_size=${groupSize} does not divide ${dim}`);
  packing(bits);
  const nBins = Math.fround(2 ** bits - 1);
  const eps = Math.fround(1e-7);
  const groups = (count * dim) / groupSize;
  const bytes = new Uint8Array((count * dim * bits) / 8);
  const scales = new Bits(groups);
  const biases = new Bits(groups);
  const w = new Float32Array(groupSize);
  for (let g = 0; g < groups; g++) {
    let min = Infinity;
    let max = -Infinity;
    for (let j = 0; j < groupSize; j++) {
      w[j] = read(values[g * groupSize + j]);
      if (w[j] > max) max = w[j];
      if (w[j] < min) min = w[j];
    }
    const towardMin = Math.abs(min) > Math.abs(max);
    let scale = Math.max(Math.fround(Math.fround(max - min) / nBins), eps);
    if (!towardMin) scale = -scale;
    const edge = towardMin ? min : max;
    const q0 = rint(Math.fround(edge / scale));
    let bias = 0;
    if (q0 !== 0) {
      scale = Math.fround(edge / q0);
      bias = edge;
    }
    // Every pack is a whole number of bytes, so the codes form one little-endian bit stream.
    for (let j = 0; j < groupSize; j++) {
      let q = rint(Math.fround(Math.fround(w[j] - bias) / scale));
      q = Math.min(Math.max(q, 0), nBins);
      const at = (g * groupSize + j) * bits;
      const shifted = q << (at & 7);
      bytes[at >> 3] |= shifted & 0xff;
      if (shifted > 0xff) bytes[(at >> 3) + 1] |= shifted >> 8;
    }
    scales[g] = write(scale);
    biases[g] = write(bias);
  }
  const packed = new Uint32Array(bytes.length / 4);
  const view = new DataView(bytes.buffer);
  for (let i = 0; i < packed.length; i++) packed[i] = view.getUint32(4 * i, true);
  return { packed, scales, biases };
}
