// Single-thread encoding speed of Hugging Face tokenizers (Rust) on a {"text"} JSONL corpus:
//   node tokenizer_bench.js TOKENIZER.json IN.jsonl
// Prints MB/s of UTF-8 text for a first (cold cache) and a second pass of encodeBatch.
'use strict';
// Sequential encode_batch in the Rust library (no rayon thread pool).
process.env.TOKENIZERS_PARALLELISM = 'false';
process.env.RAYON_NUM_THREADS = '1';
const fs = require('fs');
const tk = require('@anush008/tokenizers');

async function main() {
  const [tokenizer_path, in_path] = process.argv.slice(2);
  const tokenizer = tk.Tokenizer.fromFile(tokenizer_path);
  const texts = fs.readFileSync(in_path, 'utf8').split('\n').filter((line) => line.length > 0)
                  .map((line) => JSON.parse(line).text);
  const bytes = texts.reduce((sum, text) => sum + Buffer.byteLength(text, 'utf8'), 0);
  for (const pass of ['cold', 'warm']) {
    const start = process.hrtime.bigint();
    const encodings = await tokenizer.encodeBatch(texts, {addSpecialTokens: false});
    const seconds = Number(process.hrtime.bigint() - start) / 1e9;
    const num_ids = encodings.reduce((sum, encoding) => sum + encoding.getLength(), 0);
    console.log(`hf tokenizers (${pass}): ${texts.length} texts, ${bytes} bytes, ${num_ids} ids in ` +
                `${seconds.toFixed(3)} s = ${(bytes / 1e6 / seconds).toFixed(2)} MB/s`);
  }
}
main().catch((error) => {
  console.error(error);
  process.exit(1);
});
