#!/usr/bin/env python3
"""Writes the tokenizer parity corpus: N varied strings, one {"text": ...} JSON object per line.

Deterministic (seeded): scripts and languages, code, emoji and ZWJ sequences, combining marks in
composed and decomposed forms, whitespace and digit runs, contractions in any case, added/special
tokens inside text (also broken and nested ones), byte-level look-alikes and mojibake, random code
points from the whole Unicode range, and long runs that stress the BPE merge loop.
Usage: make_corpus.py OUT.jsonl [--count N] [--seed S]
"""
import argparse
import json
import random
import unicodedata

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.", "I'm sure they'll say we've done it, haven't we?",
    "Don't SHOUT: IT'S FINE, YOU'RE OK, WE'D KNOW.", "naïve café résumé coöperate façade jalapeño",
    "快速的棕色狐狸跳过了懒狗。今天天气很好！", "私は東京で寿司を食べました。カタカナとひらがな。",
    "안녕하세요, 만나서 반갑습니다. 한국어 문장입니다.", "مرحبا بالعالم، كيف حالك اليوم؟ ١٢٣٤٥",
    "שלום עולם, מה שלומך? עִבְרִית עם ניקוד", "नमस्ते दुनिया, आप कैसे हैं? हिन्दी पाठ।",
    "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่าง", "Привет, мир! Съешь же ещё этих мягких французских булок.",
    "Γειά σου Κόσμε! Ελληνικά κείμενα με τόνους.", "Tiếng Việt có rất nhiều dấu: ở, ữ, ặ, ệ, ộ.",
    "வணக்கம் உலகம், தமிழ் எழுத்து", "ওহে বিশ্ব, বাংলা লেখা", "გამარჯობა მსოფლიო", "Բարեւ աշխարհ",
    "ሰላም ልዑል፣ አማርኛ", "Zażółć gęślą jaźń. Příliš žluťoučký kůň.", "Ærøskøbing og Ålborg, Straße, ǅemal",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 ∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ ≤ ∞", "Emoji 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈 ❤️ 🇯🇵🇺🇸",
    "ཀ་ཁ་ག་ང་ ཏིབ་ཏི།", "ᠮᠣᠩᠭᠣᠯ ᠪᠢᠴᠢᠭ", "ꦲꦏ꧀ꦱꦫꦗꦮ", "𓀀𓀁𓂀 hieroglyphs", "ⲁⲃⲅ Coptic", "ᚠᚢᚦᚨᚱᚲ runes",
    "Ｆｕｌｌｗｉｄｔｈ　ｔｅｘｔ１２３", "ｶﾀｶﾅ half-width", "Ⅻ Ⅷ ⅷ ① ② ⑽ ½ ¾ ⁴ ₂", "U+0085:\u0085 NEL",
]
CODE = [
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "{\"key\": [1, 2.5e-3, null, true], \"s\": \"\\u00e9\"}", "<div class=\"a\">&nbsp;&amp;</div>\r\n",
    "SELECT * FROM users WHERE id=42 AND name LIKE '%o''neil%';", "x = [i*i for i in range(10) if i % 2]",
    "#include <vector>\nstd::vector<int> v{1,2,3};", "    if a != b:\n        raise ValueError('bad')\n\n\n",
    "git commit -m \"fix: off-by-one\" && make -j8 2>&1 | tee log.txt", "$ echo $((1+2)) ; ls -la ~/", "a+=b;c-=d;e*=f;g/=h",
    "http://example.com/path?q=1&r=%20#frag", "0x7fffffff 0b1010 1e10 3.14159 -0.0 1_000_000",
]
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>", "<|vision_end|>",
    "<tool_call>", "</tool_call>", "<think>", "</think>", "<|fim_prefix|>", "<tool_response>", "<|box_start|>",
    "<|im_", "<|im_end", "im_end|>", "<|IM_END|>", "< think>", "<<|im_end|>>", "<think></think>", "<|<|im_start|>",
]
CONTRACTIONS = ["'s", "'S", "'t", "'T", "'re", "'RE", "'Re", "'rE", "'ve", "'VE", "'m", "'M", "'ll", "'LL", "'Ll",
                "'d", "'D", "'ſ", "'x", "'", "''", "' s", "’s", "'sa", "'lla", "'red"]
SPACES = [" ", "  ", "\t", "\n", "\r\n", "\r", "\n\n", "\u00a0", "\u3000", "\u2028", "\u2029", "\x0b", "\x0c",
          "\u0085", "\u2003", "\u200b", "\u202f", "\u1680", "\u205f", " \n ", "\t\t\n"]
DIGITS = ["0123456789", "٠١٢٣٤٥", "۰۱۲", "०१२३", "１２３", "¹²³", "⅓", "Ⅳ", "𝟘𝟙𝟚", "৭৮", "௧௨"]
LOOKALIKES = ["\ufffd", "\\xff\\xfe", "\\u00e9", "Ġhello", "Ċ", "ĠĠĠ", "Ã©", "Ã¤Ã¶Ã¼", "â€™", "ï»¿", "\ufeff",
              "\u200d", "\ufe0f", "\u00ad", "a\u0300\u0301\u0302", "\U0010ffff", "\ue000", "\U000f0000", "\x00", "\x7f",
              "\x1b[31mred\x1b[0m", "\ud7a3", "\u1100\u1161\u11a8"]
# Blocks to draw random code points from (marks, letters of many scripts, symbols, planes 1-2, new
# Unicode 16 scripts, private use); plus the whole range.
BLOCKS = [(0x20, 0x7e), (0xa0, 0x24f), (0x300, 0x36f), (0x370, 0x3ff), (0x400, 0x4ff), (0x590, 0x5ff),
          (0x600, 0x6ff), (0x900, 0x97f), (0xe00, 0xe7f), (0x1100, 0x11ff), (0x1ab0, 0x1aff), (0x1dc0, 0x1dff),
          (0x2000, 0x206f), (0x20d0, 0x20ff), (0x2100, 0x218f), (0x3040, 0x30ff), (0x4e00, 0x4fff), (0xac00, 0xad00),
          (0xfb00, 0xfb4f), (0xfe00, 0xfe2f), (0xff00, 0xffef), (0x10d40, 0x10d8f), (0x11380, 0x113ff),
          (0x16100, 0x1613f), (0x1d400, 0x1d7ff), (0x1f300, 0x1faff), (0x20000, 0x2000f), (0x2ebf0, 0x2ee5f),
          (0xe0100, 0xe01ef)]


def random_code_point(rng):
    while True:
        if rng.random() < 0.2:
            cp = rng.randrange(0x110000)
        else:
            low, high = rng.choice(BLOCKS)
            cp = rng.randint(low, high)
        if not 0xd800 <= cp <= 0xdfff:
            return chr(cp)


def fragment(rng):
    kind = rng.randrange(12)
    if kind == 0:
        return rng.choice(SENTENCES)
    if kind == 1:
        return rng.choice(CODE)
    if kind == 2:
        return rng.choice(SPECIALS)
    if kind == 3:
        return rng.choice(["", " ", "a", "I", "we", "they", "Peter"]) + rng.choice(CONTRACTIONS)
    if kind == 4:
        return "".join(rng.choice(SPACES) for _ in range(rng.randint(1, 6)))
    if kind == 5:
        return "".join(rng.choice(DIGITS) for _ in range(rng.randint(1, 4))) + str(rng.randrange(10 ** rng.randint(1, 12)))
    if kind == 6:
        return rng.choice(LOOKALIKES)
    if kind == 7:
        return "".join(random_code_point(rng) for _ in range(rng.randint(1, 12)))
    if kind == 8:  # a word in composed or decomposed form, with extra marks in any order
        word = rng.choice(SENTENCES).split(" ")[0]
        form = rng.choice(["NFC", "NFD", "NFKD"])
        marks = "".join(chr(rng.choice([0x301, 0x323, 0x308, 0x327, 0x35c, 0x344, 0x1ab0, 0x302])) for _ in range(rng.randint(0, 3)))
        return unicodedata.normalize(form, word) + marks
    if kind == 9:  # long runs for the BPE merge loop
        unit = rng.choice(["a", "ab", " ", "\n", "=", "-", "ha", "的", "😀", "0", "\t", "aA"])
        return unit * rng.randint(20, 400)
    if kind == 10:
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(rng.randint(1, 30)))
        return word
    return rng.choice(SENTENCES).upper() if rng.random() < 0.5 else rng.choice(SENTENCES).lower()


def make_text(rng):
    if rng.random() < 0.02:
        return ""
    parts = [fragment(rng) for _ in range(rng.choice([1, 1, 2, 3, 5, 8]))]
    joiners = ["", " ", "\n", "", ""]
    return "".join(part + rng.choice(joiners) for part in parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--count", type=int, default=12000)
    parser.add_argument("--seed", type=int, default=20251202)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as out:
        fixed = SENTENCES + CODE + SPECIALS + CONTRACTIONS + SPACES + DIGITS + LOOKALIKES
        for text in fixed:
            out.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")
        for _ in range(args.count - len(fixed)):
            out.write(json.dumps({"text": make_text(rng)}, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
