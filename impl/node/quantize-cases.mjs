// Check quantize.mjs against cases mx.quantize answered (JSON on stdin: a
// list of {dtype, bits, group_size, rows, dim, x, packed, scales, biases},
// each array the raw bits, row after row). Prints each case that differs and
// exits 1; else says how many were bit-exact.

import { readFileSync } from 'node:fs';
import { quantize, DTYPES } from './quantize.mjs';

const cases = JSON.parse(readFileSync(0, 'utf8'));
let differ = 0;
for (const [i, c] of cases.entries()) {
  const Bits = DTYPES[c.dtype][2];
  const got = quantize(Bits.from(c.x), c.dtype, c.rows, c.dim, c.group_size, c.bits);
  for (const part of ['packed', 'scales', 'biases']) {
    const at = c[part].findIndex((v, k) => got[part][k] !== v);
    if (at >= 0 || got[part].length !== c[part].length) {
      differ += 1;
      console.log(`case ${i} (${c.dtype}, bits ${c.bits}, group ${c.group_size}, ${c.label}): ${part} differs at ${at}: `
        + `${got[part][at]}, mx.quantize gives ${c[part][at]}`);
      break;
    }
  }
}
console.log(`${cases.length - differ} of ${cases.length} cases bit-exact`);
process.exit(differ ? 1 : 0);
