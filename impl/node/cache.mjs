// A batched, affine-quantized KV cache in JavaScript: mlx-lm's batch cache
// protocol (BatchKVCache in mlx_lm/models/cache.py) over quantized triples,
// the same contract kvparity holds Python classes to (docs/protocol.md).
//
// Rows are left-padded and right-aligned: row i owns token columns
// [leftPadding[i], size()) of every array. Keys and values are each a
// triple [packed, scales, biases] as mx.quantize gives them (quantize.mjs):
// groups run along head_dim, so the token axis stays token granular and
// padding, joins and row selection only move whole columns.
//
// Supported: bits 2, 3, 4, 5, 6, 8; group sizes 32, 64, 128; keys and values
// of bfloat16, float16 and float32. Anything else is refused when it is
// asked for (quantize.mjs says which).
//
// Run as a program, it serves kvparity's process protocol (protocol.mjs).
//
// The bug control: KVPARITY_NODE_BUG=extract makes extract(i) drop the
// row's first token (one line, below), which the vectors and kvparity must
// find and blame on extract.

import { fileURLToPath } from 'node:url';

import { Server } from './protocol.mjs';
import { quantize, SUPPORTED_BITS } from './quantize.mjs';
import { place, shiftRow, stack, tensor } from './tensor.mjs';

export const SUPPORTED_GROUP_SIZES = [32, 64, 128];
const BUG = process.env.KVPARITY_NODE_BUG || '';

// A solo row, as mlx-lm's QuantizedKVCache holds one: offset and two triples of [1, H, >= offset, W].
export class QuantizedRow {
  constructor(offset, keys, values, bits, groupSize) {
    Object.assign(this, { offset, keys, values, bits, groupSize });
  }
}

function checkQuantization(bits, groupSize) {
  if (!SUPPORTED_BITS.includes(bits)) throw new Error(`bits=${bits} is not supported (choose from ${SUPPORTED_BITS})`);
  if (!SUPPORTED_GROUP_SIZES.includes(groupSize)) {
    throw new Error(`group_size=${groupSize} is not supported (choose from ${SUPPORTED_GROUP_SIZES})`);
  }
}

function placeTriple(triple, rows, start, stop, width, at) {
  return triple.map((t) => place(t, rows, start, stop, width, at));
}

export class BatchQuantizedKVCache {
  constructor(leftPadding, groupSize = 64, bits = 8) {
    checkQuantization(bits, groupSize);
    this.bits = bits;
    this.groupSize = groupSize;
    this.keys = null;
    this.values = null;
    this.leftPadding = [...leftPadding];
    this.offset = leftPadding.map((p) => -p);
    this.idx = 0;
    this.rightPadding = null;
  }

  size() {
    return this.idx;
  }

  // The rows of solo caches, left-padded to the longest, as one batch.
  static merge(rows) {
    const { bits, groupSize } = rows[0];
    for (const row of rows) {
      if (row.bits !== bits || row.groupSize !== groupSize) {
        throw new Error(`rows of different bits and group sizes: ${bits}/${groupSize} and ${row.bits}/${row.groupSize}`);
      }
    }
    const lengths = rows.map((r) => r.offset);
    const width = Math.max(0, ...lengths);
    const batch = new BatchQuantizedKVCache(lengths.map((n) => width - n), groupSize, bits);
    batch.offset = [...lengths];
    batch.idx = width;
    const held = rows.find((r) => r.keys);
    if (held) {
      for (const name of ['keys', 'values']) {
        batch[name] = held[name].map((like, part) => stack(rows.map((r, i) => (r[name]
          ? place(r[name][part], [0], 0, r.offset, width, width - r.offset)
          : tensor(like.dtype, [1, like.shape[1], width, like.shape[3]])))));
      }
    }
    return batch;
  }

  // Quantize keys and values [B, H, N, D] (bits of their dtype) and append them to every row.
  update_and_fetch(keys, values) {
    const [B, H, N] = keys.shape;
    const appended = [keys, values].map((dense) => {
      const D = dense.shape[3];
      const { packed, scales, biases } = quantize(dense.data, dense.dtype, B * H * N, D, this.groupSize, this.bits);
      return [tensor('uint32', [B, H, N, packed.length / (B * H * N)], packed),
        tensor(dense.dtype, [B, H, N, scales.length / (B * H * N)], scales),
        tensor(dense.dtype, [B, H, N, biases.length / (B * H * N)], biases)];
    });
    const rows = [...Array(B).keys()];
    const width = this.idx + N;
    ['keys', 'values'].forEach((name, k) => {
      this[name] = appended[k].map((fresh, part) => {
        const grown = place(fresh, rows, 0, N, width, this.idx); // the new columns, zeros before them
        if (this[name]) {
          // The old columns, zeros after them: the two cover disjoint columns, so OR joins them.
          const old = place(this[name][part], rows, 0, this.idx, width, 0);
          for (let i = 0; i < grown.data.length; i++) old.data[i] |= grown.data[i];
          return old;
        }
        return grown;
      });
    });
    this.idx = width;
    this.offset = this.offset.map((n) => n + N);
    return [this.keys, this.values];
  }

  get state() {
    return [this.keys, this.values];
  }

  prepare({ left_padding: leftPadding, right_padding: rightPadding } = {}) {
    if (leftPadding) {
      if (this.keys) throw new Error('left padding can only be added to an empty batch');
      this.leftPadding = this.leftPadding.map((p, i) => p + leftPadding[i]);
      this.offset = this.offset.map((n, i) => n - leftPadding[i]);
    }
    if (rightPadding && Math.max(...rightPadding) > 0) this.rightPadding = [...rightPadding];
  }

  finalize() {
    if (!this.rightPadding) return;
    const padding = this.rightPadding;
    this.rightPadding = null;
    this.offset = this.offset.map((n, i) => n - padding[i]);
    this.shiftRowsRight(padding);
  }

  // Drop the last n tokens of every row.
  trim(n) {
    const shortest = Math.min(...this.offset);
    if (n < 0 || n > shortest) throw new Error(`cannot trim ${n} tokens: the shortest row holds ${shortest}`);
    this.cut(this.idx - n);
    this.offset = this.offset.map((k) => k - n);
    return n;
  }

  // Drop the last amounts[i] tokens of row i, then re-align the rows to end at size().
  rollback(amounts) {
    if (amounts.length !== this.offset.length) throw new Error(`${amounts.length} amounts for ${this.offset.length} rows`);
    amounts.forEach((a, i) => {
      if (a < 0 || a > this.offset[i]) throw new Error(`cannot roll back ${a} tokens of row ${i}: it holds ${this.offset[i]}`);
    });
    const common = Math.min(...amounts);
    this.cut(this.idx - common);
    this.offset = this.offset.map((n, i) => n - amounts[i]);
    this.shiftRowsRight(amounts.map((a) => a - common));
  }

  cut(width) {
    for (const name of ['keys', 'values']) {
      if (this[name]) this[name] = placeTriple(this[name], [...this.offset.keys()], 0, width, width, 0);
    }
    this.idx = width;
  }

  shiftRowsRight(shifts) {
    if (Math.max(0, ...shifts) === 0) return;
    this.leftPadding = this.leftPadding.map((p, i) => p + shifts[i]);
    for (const name of ['keys', 'values']) {
      for (const t of this[name] || []) shifts.forEach((s, b) => s && shiftRow(t, b, s));
    }
    this.dropSharedPadding();
  }

  dropSharedPadding() {
    const shared = Math.min(...this.leftPadding);
    if (!(shared > 0)) return;
    for (const name of ['keys', 'values']) {
      if (this[name]) this[name] = placeTriple(this[name], [...this.offset.keys()], shared, this.idx, this.idx - shared, 0);
    }
    this.idx -= shared;
    this.leftPadding = this.leftPadding.map((p) => p - shared);
  }

  // Keep the given rows, in the given order, then drop the padding they all share.
  filter(indices) {
    for (const name of ['keys', 'values']) {
      if (this[name]) this[name] = placeTriple(this[name], indices, 0, this.idx, this.idx, 0);
    }
    this.leftPadding = indices.map((i) => this.leftPadding[i]);
    this.offset = indices.map((i) => this.offset[i]);
    this.dropSharedPadding();
  }

  // Append the rows of another batch; the narrower side's padding grows.
  extend(other) {
    const width = Math.max(this.idx, other.idx);
    const aligned = (batch) => {
      const shift = width - batch.idx;
      const rows = [...batch.offset.keys()];
      return {
        keys: batch.keys && placeTriple(batch.keys, rows, 0, batch.idx, width, shift),
        values: batch.values && placeTriple(batch.values, rows, 0, batch.idx, width, shift),
        leftPadding: batch.leftPadding.map((p) => p + shift),
      };
    };
    const [mine, theirs] = [aligned(this), aligned(other)];
    for (const name of ['keys', 'values']) {
      const like = mine[name] || theirs[name];
      if (!like) continue;
      const filled = (side, batch) => side[name] || like.map((t) => tensor(t.dtype, [batch.offset.length, t.shape[1], width, t.shape[3]]));
      this[name] = like.map((_, part) => stack([filled(mine, this)[part], filled(theirs, other)[part]]));
    }
    this.leftPadding = [...mine.leftPadding, ...theirs.leftPadding];
    this.offset = [...this.offset, ...other.offset];
    this.idx = width;
  }

  // Row i alone, as a solo quantized cache holding its own copy of its columns.
  extract(i) {
    const start = this.leftPadding[i] + (BUG === 'extract' ? 1 : 0); // the bug control's one line
    const length = this.idx - this.leftPadding[i];
    const copy = (triple) => triple && placeTriple(triple, [i], start, this.idx, this.idx - start, 0);
    return new QuantizedRow(length, copy(this.keys), copy(this.values), this.bits, this.groupSize);
  }

  // The causal mask for N new tokens that also hides each row's left padding (and, with a
  // window, columns window or more behind the query): bool [B, 1, N, size() + N], true where a
  // query may attend.
  make_mask(N, windowSize = null) {
    const B = this.offset.length;
    const width = this.idx + N;
    const mask = tensor('bool', [B, 1, N, width]);
    for (let b = 0; b < B; b++) {
      for (let q = 0; q < N; q++) {
        const first = Math.max(this.leftPadding[b], windowSize ? this.idx + q - windowSize + 1 : 0);
        for (let c = first; c <= this.idx + q; c++) mask.data[(b * N + q) * width + c] = 1;
      }
    }
    return mask;
  }

  // A batch equal to this one that shares nothing with it (mlx-lm's BatchGenerator deep-copies batches).
  copy() {
    const twin = Object.assign(Object.create(BatchQuantizedKVCache.prototype), this);
    for (const name of ['keys', 'values']) {
      twin[name] = this[name] && this[name].map((t) => tensor(t.dtype, t.shape, t.data.slice()));
    }
    twin.leftPadding = [...this.leftPadding];
    twin.offset = [...this.offset];
    twin.rightPadding = this.rightPadding && [...this.rightPadding];
    return twin;
  }

  // The bytes the batch holds.
  get nbytes() {
    const all = [...(this.keys || []), ...(this.values || [])];
    return all.reduce((n, t) => n + t.data.byteLength, 0);
  }
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  new Server(BatchQuantizedKVCache, QuantizedRow, {
    name: 'BatchQuantizedKVCache (impl/node)', version: '0.1.0',
  }).serve();
}
