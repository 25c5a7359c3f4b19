// Asks the reference (Hugging Face tokenizers) which code points are in \p{L}, \p{M}, \p{N}, \s and
// which change under NFC; writes "cp L M N S nfc_changed" lines for every scalar value.
'use strict';
const tk = require('@anush008/tokenizers');
const fs = require('fs');

const kMax = 0x110000;
const chars = [];
for (let cp = 0; cp < kMax; ++cp) if (cp < 0xd800 || cp > 0xdfff) chars.push(cp);

// A class member becomes its own piece when isolated by splitting on the class; separators keep
// neighbours apart so that a piece equal to one code point means membership.
function members(pattern) {
  const set = new Set();
  const split = regex_split(pattern);
  const batch = 65536;
  for (let i = 0; i < chars.length; i += batch) {
    const part = chars.slice(i, i + batch);
    const text = part.map((cp) => '\u0001' + String.fromCodePoint(cp)).join('');
    for (const [piece] of split.preTokenizeString(text)) {
      const cps = Array.from(piece);
      if (cps.length === 1) set.add(cps[0].codePointAt(0));
    }
  }
  return set;
}
// The binding's splitPreTokenizer takes a literal string, so the regex form comes from JSON.
function regex_split(pattern) {
  const config = {
    version: '1.0', added_tokens: [], normalizer: null, post_processor: null, decoder: null,
    pre_tokenizer: {type: 'Split', pattern: {Regex: pattern}, behavior: 'Isolated', invert: false},
    model: {type: 'BPE', vocab: {}, merges: []},
  };
  return tk.Tokenizer.fromString(JSON.stringify(config)).getPreTokenizer();
}
const letter = members('\\p{L}'), mark = members('\\p{M}'), number = members('\\p{N}'), space = members('\\s');
const nfc = tk.nfcNormalizer();
const lines = [];
for (const cp of chars) {
  const s = String.fromCodePoint(cp);
  const changed = nfc.normalizeString(s) !== s ? 1 : 0;
  const flags = [letter.has(cp), mark.has(cp), number.has(cp), space.has(cp)].map((x) => x && cp !== 1).map(Number);
  if (flags.some((x) => x) || changed) lines.push(`${cp.toString(16)} ${flags.join(' ')} ${changed}`);
}
fs.writeFileSync(process.argv[2], lines.join('\n') + '\n');
