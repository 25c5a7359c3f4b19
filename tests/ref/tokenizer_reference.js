// Reference encodings from Hugging Face tokenizers (Rust, through @anush008/tokenizers):
//   node tokenizer_reference.js TOKENIZER.json IN.jsonl OUT.jsonl
// IN has one {"text": ...} per line; OUT gets {"ids": [...], "decoded": ..., "is_nfc": bool} per
// line, where decoded = decode(ids) and is_nfc says whether NFC leaves the text unchanged.
'use strict';
const fs = require('fs');
const tk = require('@anush008/tokenizers');

async function main() {
  const [tokenizer_path, in_path, out_path] = process.argv.slice(2);
  if (!out_path) throw new Error('usage: node tokenizer_reference.js TOKENIZER.json IN.jsonl OUT.jsonl');
  const tokenizer = tk.Tokenizer.fromFile(tokenizer_path);
  const nfc = tk.nfcNormalizer();
  const texts = fs.readFileSync(in_path, 'utf8').split('\n').filter((line) => line.length > 0)
                  .map((line) => JSON.parse(line).text);
  const lines = [];
  const kBatch = 1000;
  for (let i = 0; i < texts.length; i += kBatch) {
    const batch = texts.slice(i, i + kBatch);
    const encodings = await tokenizer.encodeBatch(batch, {addSpecialTokens: false});
    const ids = encodings.map((encoding) => encoding.getIds());
    const decoded = await tokenizer.decodeBatch(ids, false);
    for (let j = 0; j < batch.length; ++j) {
      lines.push(JSON.stringify({ids: ids[j], decoded: decoded[j], is_nfc: nfc.normalizeString(batch[j]) === batch[j]}));
    }
  }
  fs.writeFileSync(out_path, lines.join('\n') + '\n');
}

main().catch((error) => {
  console.error(`tokenizer_reference.js: ${error.stack || error}`);
  process.exit(1);
});
