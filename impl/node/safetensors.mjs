// Read a safetensors file: 8 bytes little-endian header length, a JSON
// header (each tensor's dtype, shape and byte range), then the bytes.

import { readFileSync } from 'node:fs';
import { tensor } from './tensor.mjs';

const DTYPES = { U32: 'uint32', I32: 'int32', F32: 'float32', F16: 'float16', BF16: 'bfloat16', BOOL: 'bool', U8: 'uint8' };

export function readSafetensors(path) {
  const file = readFileSync(path);
  const length = Number(file.readBigUInt64LE(0));
  const header = JSON.parse(file.subarray(8, 8 + length).toString('utf8'));
  const body = file.subarray(8 + length);
  const tensors = {};
  for (const [name, entry] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const dtype = DTYPES[entry.dtype];
    if (!dtype) throw new Error(`${path}: tensor ${name} has dtype ${entry.dtype}, which this reader does not know`);
    const [start, stop] = entry.data_offsets;
    const bytes = new Uint8Array(stop - start);
    bytes.set(body.subarray(start, stop)); // a copy: aligned for the typed array over it
    const t = tensor(dtype, entry.shape);
    t.data = new t.data.constructor(bytes.buffer, 0, t.data.length); // little-endian hosts (every Node target)
    tensors[name] = t;
  }
  return tensors;
}
