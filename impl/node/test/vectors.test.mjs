// kvparity's conformance vectors on this cache, in node --test:
//   kvparity vectors export VECTORS && KVPARITY_VECTORS=VECTORS node --test impl/node/
// Each schedule's calls are replayed in order on BatchQuantizedKVCache and,
// after each, what the vectors expect is compared bit for bit (docs/vectors.md).

import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';

import { BatchQuantizedKVCache, QuantizedRow } from '../cache.mjs';
import { readSafetensors } from '../safetensors.mjs';
import { equalBits, firstDifference, place, tensor } from '../tensor.mjs';

const FORMAT_VERSION = 1;
const directory = process.env.KVPARITY_VECTORS;

if (!directory) {
  test('conformance vectors', () => {
    assert.fail('no vectors: export them (kvparity vectors export DIR) and set KVPARITY_VECTORS=DIR');
  });
} else {
  const manifest = JSON.parse(readFileSync(join(directory, 'manifest.json'), 'utf8'));
  test('manifest', () => {
    assert.equal(manifest.format, 'kvparity-vectors');
    assert.equal(manifest.format_version, FORMAT_VERSION, 'a format this runner reads');
    for (const [name, digest] of Object.entries(manifest.files)) {
      const actual = createHash('sha256').update(readFileSync(join(directory, name))).digest('hex');
      assert.equal(actual, digest, `${name}: sha256 is not the manifest's`);
    }
  });
  for (const entry of manifest.schedules) {
    test(entry.name, () => {
      const failures = replay(entry);
      assert.deepEqual(failures.slice(0, 1), [], `${failures.length} failures`);
    });
  }
}

const PARTS = ['packed', 'scales', 'biases'];

// Replay one schedule's calls; returns the divergences, each naming the member after which it showed.
export function replay(entry, Cache = BatchQuantizedKVCache) {
  const cases = JSON.parse(readFileSync(join(directory, entry.cases), 'utf8'));
  const tensors = readSafetensors(join(directory, cases.tensors));
  const failures = [];
  const batches = new Map();
  const extracted = new Map();
  const rowTriple = (layer, row, name) => (row.length === 0 ? null : PARTS.map((part) => {
    const pieces = row.tokens.map(([stream, start, stop]) => {
      const tape = tensors[`tape/L${layer}/${stream}/${name}.${part}`];
      return place(tensor(tape.dtype, [1, ...tape.shape], tape.data), [0], start, stop, stop - start, 0);
    });
    const H = pieces[0].shape[1];
    const W = pieces[0].shape[3];
    const out = tensor(pieces[0].dtype, [1, H, row.length, W]);
    let at = 0;
    for (const p of pieces) {
      const n = p.shape[2];
      for (let h = 0; h < H; h++) out.data.set(p.data.subarray(h * n * W, (h + 1) * n * W), (h * row.length + at) * W);
      at += n;
    }
    return out;
  }));
  const soloRow = (layer, row) => {
    const keys = row.length ? rowTriple(layer, row, 'keys') : null;
    const values = row.length ? rowTriple(layer, row, 'values') : null;
    return new QuantizedRow(row.length, keys, values, cases.bits, cases.group_size);
  };
  const fail = (record, what) => failures.push(`${cases.schedule}: after call ${record.call} (${record.member}, `
    + `layer ${record.layer}, event ${record.event}): ${what}`);
  // Row b of `triples` (keys, values), columns [start, start + row.length), against the expected row.
  const compareRow = (record, layer, triples, b, start, row, where) => {
    for (const [k, name] of ['keys', 'values'].entries()) {
      const expected = rowTriple(layer, row, name);
      if (!expected) continue;
      expected.forEach((want, p) => {
        const got = triples?.[k]?.[p];
        if (!got) return fail(record, `${where}.${name}.${PARTS[p]}: missing`);
        if (start < 0 || start + row.length > got.shape[2]) {
          return fail(record, `${where}.${name}.${PARTS[p]}: row ${row.request} needs columns [${start}, ${start + row.length}) of ${got.shape[2]}`);
        }
        const mine = place(got, [b], start, start + row.length, row.length, 0);
        if (!equalBits(mine, want)) {
          const i = firstDifference(mine, want);
          fail(record, `${where}.${name}.${PARTS[p]} of row ${row.request} differs at flat index ${i}: ${mine.data[i]}, expected ${want.data[i]}`);
        }
      });
    }
  };
  const checkLayout = (record, batch, expected, fetched) => {
    if (batch.bits !== cases.bits || batch.groupSize !== cases.group_size) {
      fail(record, `bits/group_size ${batch.bits}/${batch.groupSize}, expected ${cases.bits}/${cases.group_size}`);
    }
    if (expected.layout === 'none') return;
    const size = batch.size();
    expected.rows.forEach((row, b) => {
      if (expected.layout === 'prefill') { // each row after the padding its merge gave it
        const pad = expected.left_padding[b];
        compareRow(record, record.layer, batch.state, b, pad, row, 'state');
        if (fetched) compareRow(record, record.layer, fetched, b, pad, row, 'fetched');
        return;
      }
      if (batch.offset[b] !== row.length) fail(record, `offset of row ${row.request} is ${batch.offset[b]}, expected ${row.length}`);
      const pad = batch.leftPadding[b];
      if (size - pad !== row.length) {
        return fail(record, `size() ${size} - left_padding ${pad} of row ${row.request} is not its length ${row.length}`);
      }
      compareRow(record, record.layer, batch.state, b, pad, row, 'state');
      if (fetched) compareRow(record, record.layer, fetched, b, fetched[0][0].shape[2] - row.length, row, 'fetched');
    });
  };
  const call = (record) => {
    const { member, args, layer } = record;
    let batch = batches.get(record.batch);
    let fetched = null;
    try {
      if (member === 'merge') {
        const rows = args.rows.map((row) => soloRow(layer, row));
        const copies = rows.map((r) => JSON.stringify([r.keys, r.values].flat().map((t) => t && Array.from(t.data))));
        batch = Cache.merge(rows);
        batches.set(record.batch, batch);
        rows.forEach((r, i) => {
          const now = JSON.stringify([r.keys, r.values].flat().map((t) => t && Array.from(t.data)));
          if (now !== copies[i]) fail(record, `merge changed its source row ${i}`);
        });
      } else if (member === 'extend') batch.extend(batches.get(args.other));
      else if (member === 'filter') batch.filter(args.indices);
      else if (member === 'trim') batch.trim(args.n);
      else if (member === 'rollback') batch.rollback(args.amounts);
      else if (member === 'prepare') batch.prepare(args);
      else if (member === 'finalize') batch.finalize();
      else if (member === 'update_and_fetch') fetched = batch.update_and_fetch(tensors[args.keys], tensors[args.values]);
      else if (member === 'extract') extracted.set(record.call, batch.extract(args.index));
      else throw new Error(`unknown member ${member}`);
    } catch (error) {
      fail(record, `${member} raised ${error.message}`);
      return;
    }
    if (member === 'extract') {
      const row = record.expected.extracted;
      const got = extracted.get(record.call);
      if (got.offset !== row.length || got.bits !== cases.bits || got.groupSize !== cases.group_size) {
        fail(record, `extracted row has offset ${got.offset}, bits ${got.bits}, group size ${got.groupSize}; expected ${row.length}, ${cases.bits}, ${cases.group_size}`);
      }
      compareRow(record, layer, [got.keys, got.values], 0, 0, row, 'extracted');
    } else {
      checkLayout(record, batch, record.expected, fetched);
    }
  };
  const compareAll = (record, triples, row, where) => compareRow(record, record.layer, triples, 0, 0, row, where);
  for (const event of cases.events) {
    for (let k = event.calls[0]; k < event.calls[1]; k++) {
      call(cases.calls[k]);
      if (failures.length) return failures; // the first call after which something diverged names the member
    }
    // The event's end: the exact layout (no padding every row shares), the masks, the stored rows.
    for (const expected of event.layers) {
      const batch = batches.get(expected.batch);
      const lastCall = [...cases.calls.slice(0, event.calls[1])].reverse().find((r) => r.batch === expected.batch && r.member !== 'extract');
      const at = { ...(lastCall || { call: event.calls[1] - 1, member: '(none)' }), layer: expected.layer, event: event.event };
      if (batch.size() !== expected.size || batch.leftPadding.some((p, i) => p !== expected.left_padding[i])) {
        fail(at, `at the end of event ${event.label}: size() ${batch.size()} and left_padding [${batch.leftPadding}], expected ${expected.size} and [${expected.left_padding}] (no column may be padding in every row)`);
      }
      checkLayout(at, batch, expected, null);
      // nbytes counts at least the bytes the rows' columns occupy.
      const held = expected.rows.reduce((n, row) => n + ['keys', 'values'].reduce((m, name) => m
        + (rowTriple(expected.layer, row, name) || []).reduce((k, t) => k + t.data.byteLength, 0), 0), 0);
      if (!(batch.nbytes >= held)) fail({ ...at, member: 'nbytes' }, `nbytes ${batch.nbytes}, the rows' columns hold ${held} bytes`);
      // extract(i) of every row gives the row, and leaves the batch as it was.
      expected.rows.forEach((row, b) => {
        const got = batch.extract(b);
        const where = { ...at, member: 'extract' };
        if (got.offset !== row.length || got.bits !== cases.bits || got.groupSize !== cases.group_size) {
          fail(where, `extract(${b}) has offset ${got.offset}, bits ${got.bits}, group size ${got.groupSize}; expected ${row.length}, ${cases.bits}, ${cases.group_size}`);
        }
        compareRow(where, expected.layer, [got.keys, got.values], 0, 0, row, `extract(${b})`);
      });
      checkLayout({ ...at, member: 'extract' }, batch, expected, null);
      for (const [n, name] of Object.entries(expected.masks)) {
        const want = tensors[name];
        const got = batch.make_mask(Number(n));
        const mask = { ...at, member: 'make_mask' };
        if (got.data.length !== want.data.length) {
          fail(mask, `make_mask(${n}) has ${got.data.length} elements, expected ${want.data.length} [${want.shape}]`);
        } else if (firstDifference(got, want) >= 0) {
          const i = firstDifference(got, want);
          fail(mask, `make_mask(${n}) differs at flat index ${i} of [${want.shape}]: ${got.data[i]}, expected ${want.data[i]}`);
        }
      }
    }
    for (const k of event.stored) {
      const record = cases.calls[k];
      const row = extracted.get(k);
      compareAll({ ...record, member: 'extract' }, [row.keys, row.values], record.expected.extracted, `stored row of event ${event.label}`);
    }
    if (failures.length) return failures;
  }
  return failures;
}
