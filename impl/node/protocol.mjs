// kvparity's process protocol, the cache side: frames on stdin and stdout
// (docs/protocol.md, "Caches in other languages"). Every message is "KVP1",
// a uint32 little-endian header length, a UTF-8 JSON header, then the raw
// bytes of each tensor the header lists, in order. The process speaks
// first (hello), then answers each request in turn; batches live here,
// named by handles; solo rows cross the pipe as tensors. Nothing but frames
// goes to stdout; stderr is free text.

import { SUPPORTED_BITS, SUPPORTED_DTYPES } from './quantize.mjs';
import { tensor, size } from './tensor.mjs';

const MAGIC = Buffer.from('KVP1');
const ITEMSIZE = { uint32: 4, int32: 4, float32: 4, float16: 2, bfloat16: 2, bool: 1 };
const PARTS = ['packed', 'scales', 'biases'];

class NotImplementedError extends Error {
  constructor(message) {
    super(message);
    this.name = 'NotImplementedError';
  }
}

export function encode(header, tensors = []) {
  const entries = tensors.map(([name, t]) => ({ name, dtype: t.dtype, shape: t.shape }));
  const text = Buffer.from(JSON.stringify({ ...header, tensors: entries }), 'utf8');
  const length = Buffer.alloc(4);
  length.writeUInt32LE(text.length);
  const data = tensors.map(([, t]) => Buffer.from(t.data.buffer, t.data.byteOffset, t.data.byteLength));
  return Buffer.concat([MAGIC, length, text, ...data]);
}

// Frames out of a byte stream: push chunks, take whole messages.
export class FrameReader {
  constructor() {
    this.buffer = Buffer.alloc(0);
  }

  push(chunk) {
    this.buffer = this.buffer.length ? Buffer.concat([this.buffer, chunk]) : chunk;
  }

  take() {
    const b = this.buffer;
    if (b.length < 8) return null;
    if (!b.subarray(0, 4).equals(MAGIC)) throw new Error(`no frame: ${JSON.stringify(b.subarray(0, 16).toString('latin1'))}`);
    const length = b.readUInt32LE(4);
    if (b.length < 8 + length) return null;
    const header = JSON.parse(b.subarray(8, 8 + length).toString('utf8'));
    let at = 8 + length;
    const need = (header.tensors || []).reduce((n, e) => n + size(e.shape) * ITEMSIZE[e.dtype], 0);
    if (b.length < at + need) return null;
    const tensors = {};
    for (const e of header.tensors || []) {
      const bytes = size(e.shape) * ITEMSIZE[e.dtype];
      const copy = new Uint8Array(bytes);
      copy.set(b.subarray(at, at + bytes)); // aligned, and ours
      const t = tensor(e.dtype, e.shape);
      t.data = new t.data.constructor(copy.buffer, 0, t.data.length);
      tensors[e.name] = t;
      at += bytes;
    }
    this.buffer = b.subarray(at);
    return { header, tensors };
  }
}

const triple = (prefix, t) => PARTS.map((part, i) => [`${prefix}.${part}`, t[i]]);
const int32 = (values) => tensor('int32', [values.length], Int32Array.from(values));

// The ops on a cache class with BatchQuantizedKVCache's members and a row class.
export class Server {
  constructor(Cache, Row, about) {
    Object.assign(this, { Cache, Row, about });
    this.batches = new Map();
    this.next = 1;
  }

  hello() {
    return {
      protocol: 1, language: 'javascript', capabilities: ['per_row_rollback'],
      bits: SUPPORTED_BITS, group_sizes: [32, 64, 128], dtypes: SUPPORTED_DTYPES, ...this.about,
    };
  }

  batch(handle) {
    const found = this.batches.get(handle);
    if (!found) throw new Error(`no batch ${handle}`);
    return found;
  }

  // One request: [result, tensors].
  answer(op, args, tensors) {
    const batch = () => this.batch(args.batch);
    switch (op) {
      case 'merge': {
        const rows = args.rows.map((row, i) => {
          if (row.bits === null) throw new NotImplementedError('merge takes quantized rows only');
          const part = (name) => PARTS.map((p) => tensors[`rows.${i}.${name}.${p}`]);
          return new this.Row(row.offset, row.filled ? part('keys') : null, row.filled ? part('values') : null,
            row.bits, row.group_size);
        });
        const handle = this.next++;
        this.batches.set(handle, this.Cache.merge(rows));
        return [{ batch: handle }, []];
      }
      case 'copy': {
        const handle = this.next++;
        this.batches.set(handle, batch().copy());
        return [{ batch: handle }, []];
      }
      case 'extend': batch().extend(this.batch(args.other)); return [{}, []];
      case 'filter': batch().filter(args.indices); return [{}, []];
      case 'trim': return [{ trimmed: batch().trim(args.n) }, []];
      case 'rollback': batch().rollback(args.amounts); return [{}, []];
      case 'prepare': batch().prepare(args); return [{}, []];
      case 'finalize': batch().finalize(); return [{}, []];
      case 'extract': {
        const row = batch().extract(args.index);
        const filled = Boolean(row.keys);
        return [{ offset: row.offset, bits: row.bits, group_size: row.groupSize, filled },
          filled ? [...triple('keys', row.keys), ...triple('values', row.values)] : []];
      }
      case 'update_and_fetch': {
        const [keys, values] = batch().update_and_fetch(tensors.keys, tensors.values);
        return [{}, [...triple('keys', keys), ...triple('values', values)]];
      }
      case 'make_mask': return [{ mask: 'array' }, [['mask', batch().make_mask(args.N, args.window_size)]]];
      case 'size': return [{ size: batch().size() }, []];
      case 'offset': return [{}, [['offset', int32(batch().offset)]]];
      case 'left_padding': return [{}, [['left_padding', int32(batch().leftPadding)]]];
      case 'state': {
        const [keys, values] = batch().state;
        return keys ? [{ filled: true }, [...triple('keys', keys), ...triple('values', values)]] : [{ filled: false }, []];
      }
      case 'nbytes': return [{ nbytes: batch().nbytes }, []];
      case 'bits': return [{ bits: batch().bits }, []];
      case 'group_size': return [{ group_size: batch().groupSize }, []];
      case 'empty': return [{ empty: !batch().keys }, []];
      case 'free': for (const h of args.batches) this.batches.delete(h); return [{}, []];
      default: throw new NotImplementedError(`op ${op}`);
    }
  }

  // Serve stdin -> stdout until stdin ends.
  serve(input = process.stdin, output = process.stdout) {
    const reader = new FrameReader();
    output.write(encode({ id: 0, ok: true, op: 'hello', result: this.hello() }));
    input.on('data', (chunk) => {
      reader.push(chunk);
      for (let message = reader.take(); message; message = reader.take()) {
        const { id, op, args = {} } = message.header;
        let frame;
        try {
          const [result, tensors] = this.answer(op, args, message.tensors);
          frame = encode({ id, ok: true, result }, tensors);
        } catch (error) {
          const type = error.name === 'Error' ? 'ValueError' : error.name;
          frame = encode({ id, ok: false, error: { type, message: error.message } });
        }
        output.write(frame);
      }
    });
    input.on('end', () => process.exit(0));
  }
}
