#!/usr/bin/env python3
"""Independent token-id and chat-template reference for the real checkpoints' tokenizers.

Writes tests/fixtures/tokenizer_reference.json, which tests/tests/tokenizers_real.rs
checks Tandem against. Nothing here shares code with Tandem: the GGUF metadata is
read with the `gguf` package, and every text is tokenized by two or three
implementations that must agree before anything is recorded:

* byte-level BPE (`tokenizer.ggml.model = gpt2`: Qwen2.5, SmolLM2)
  - `hand`: a `tokenizers` BPE on the file's vocabulary and merges with the
    model family's own pre-tokenizer, as its tokenizer.json has it (Qwen2: NFC,
    then the Qwen2 split regex and ByteLevel(use_regex=False); SmolLM2: single
    digits, then ByteLevel's GPT-2 regex);
  - `transformers`: transformers' own GGUF tokenizer conversion
    (`convert_gguf_tokenizer`) fed the file's metadata (its GGUF reader needs
    PyTorch, so the metadata is read here with `gguf` instead);
  - `llama.cpp`: a pure-Python port of llama.cpp's llm_tokenizer_bpe
    (special tokens cut out longest first, its pre-tokenizer regex, merges by rank).
* SentencePiece (`tokenizer.ggml.model = llama`: Gemma 3)
  - `transformers`, as above;
  - `llama.cpp`: a pure-Python port of llama.cpp's llm_tokenizer_spm (bigram
    merges by score, the leftmost on ties; pieces not in the vocabulary back to
    their parts, then `<0xNN>` bytes; spaces as U+2581; a dummy prefix space only
    with add_space_prefix).

Where the references disagree the case is recorded with each one's ids
(`by_reference`, and listed under `disagreements`), and `ids` follows the
tokenizer the model was trained with: for byte-level BPE the `hand` build of its
tokenizer.json (Qwen2's NFC normalization is in neither transformers' GGUF
conversion nor llama.cpp); for SentencePiece `llama.cpp`, whose longest-first
matching of user-defined tokens (Gemma's runs of spaces) is what SentencePiece
itself does, where transformers' conversion rebuilds them as merges.

Chat templates are rendered by transformers' own `render_jinja_template`: Qwen2.5's
from the file's `tokenizer.chat_template`, Gemma 3's from the template Google ships
with the instruction-tuned Gemma 3 models (the 270m base file carries none).

    pip install -r tests/reference/requirements.txt
    python3 tests/reference/tokenizer_reference.py        # ~2 min, needs the files of MODELS
"""

import argparse
import json
import os
import platform
import sys
import time
import unicodedata
from importlib.metadata import version

import gguf
import jinja2
import regex
import tokenizers
from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers.integrations.gguf.gguf_tokenizer_mapping import (
    GGUF_TOKENIZER_MAPPING,
    convert_gguf_tokenizer,
)
from transformers.utils.chat_template_utils import render_jinja_template

# name (as in scripts/models.tsv) -> file in the model cache
MODELS = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-0.5b": "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    "qwen2.5-1.5b": "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
    "gemma-3-270m": "gemma-3-270m.Q4_K_M.gguf",
}

CASES = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, isn't it? We'VE DONE it.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\treturn {'a': [1, 2]}\n\n\n\n# end\r\n",
    "3.14159 and 1234567890, 2026-12-02 12:00",
    "naïve café, Ångström, déjà vu — “quoted” ½",
    "cafe\u0301 vs caf\u00e9",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 🙂🎉👩‍💻 end",
    "  two leading spaces",
    "trailing spaces  ",
    "a  b   c    d\t\te",
    " ",
    "\n",
    "\n\n\n",
    " " * 40 + "x",
    "\n" * 35 + "y",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "Hello<|im_end|>world<|endoftext|>",
    "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>",
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after bos<eos>",
    "<b>bold</b> <table><tr><td>cell</td></tr></table>",
    "<unk> and <pad> and <mask>",
    "DON'T STOP, he'D said. 'Quoted' words' ends",
    "line one\r\nline two\r\n\r\n  \n \t\n",
    "nbsp\u00a0here, ideographic\u3000space, zero\u200bwidth, soft\u00adhyphen",
    "x² + y³ = ½, ①②, ١٢٣ and ＡＢＣ１２３",
    "control \x00\x01\x7f chars",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 🇫🇷 flags and e\u0300\u0301\u0302 stacked",
    "x",
    "",
]

# Long texts, tokenized whole: (name, path from the repository root)
LONG_TEXTS = [("opticks-part1", "../shared/eval/opticks-part1.txt")]
# Long texts are recorded as FNV-1a hashes of blocks of this many ids.
HASH_BLOCK = 512

# The chat template of Google's instruction-tuned Gemma 3 checkpoints (tokenizer_config.json).
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\n'}}
{%- endif -%}
"""

SYSTEM = ("system", "You are a terse assistant. Answer in one line.")
USER = ("user", "Write hello world in Python.")
ASSISTANT = ("assistant", "print('hello world')\n")
USER2 = ("user", "  And in Rust?  ")

# (messages, add_generation_prompt); the roles follow every template's rules
CONVERSATIONS = [
    ([SYSTEM, USER, ASSISTANT], False),
    ([SYSTEM, USER], True),
    ([USER], True),
    ([SYSTEM, USER, ASSISTANT, USER2], True),
    ([USER, ASSISTANT, USER2], False),
]
# conversations Gemma's template refuses
GEMMA_REFUSED = [
    ([ASSISTANT, USER], True),
    ([USER, USER2], True),
    ([SYSTEM, SYSTEM, USER], True),
]

# Qwen2's pre-tokenizer split, as its tokenizer.json writes it.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's spelling of the same regex, and of its "smollm" split (after single digits)
LLAMACPP_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
                  r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMACPP_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

TYPE_NORMAL, TYPE_UNKNOWN, TYPE_CONTROL, TYPE_USER_DEFINED, TYPE_UNUSED, TYPE_BYTE = 1, 2, 3, 4, 5, 6


# --------------------------------------------------------------------------
# GGUF metadata
# --------------------------------------------------------------------------

def read_metadata(path):
    """The file's `tokenizer.*` keys and its architecture, as Python values."""
    reader = GGUFReader(path)
    keep = lambda k: k.startswith("tokenizer.") or k == "general.architecture"
    return {k: f.contents() for k, f in reader.fields.items() if keep(k)}


class Vocab:
    def __init__(self, md):
        self.tokens = list(md["tokenizer.ggml.tokens"])
        self.types = [int(t) for t in md["tokenizer.ggml.token_type"]]
        self.ids = {t: i for i, t in enumerate(self.tokens)}
        assert len(self.ids) == len(self.tokens), "duplicate tokens"
        self.bos = md.get("tokenizer.ggml.bos_token_id")
        self.eos = md.get("tokenizer.ggml.eos_token_id")
        self.add_bos = bool(md.get("tokenizer.ggml.add_bos_token", md["tokenizer.ggml.model"] == "llama"))
        self.add_space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))

    def of_types(self, *types):
        return [i for i, t in enumerate(self.types) if t in types]

    def end_of_generation(self):
        """llama.cpp's end-of-generation set: EOS, EOT, and the end-of-turn texts it knows."""
        texts = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                 "<EOT>", "_<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"}
        ids = {i for i, t in enumerate(self.tokens) if t in texts}
        if self.eos is not None:
            ids.add(int(self.eos))
        return sorted(ids)


def special_partition(vocab, text):
    """llama.cpp's tokenizer_st_partition: control, unknown and user-defined tokens
    cut out of the text, longest token text first. Yields ints and strings."""
    specials = sorted(vocab.of_types(TYPE_CONTROL, TYPE_UNKNOWN, TYPE_USER_DEFINED),
                      key=lambda i: len(vocab.tokens[i].encode("utf-8")), reverse=True)
    fragments = [text] if text else []
    for sid in specials:
        piece = vocab.tokens[sid]
        out = []
        for frag in fragments:
            if not isinstance(frag, str):
                out.append(frag)
                continue
            while True:
                at = frag.find(piece)
                if at < 0:
                    break
                if at > 0:
                    out.append(frag[:at])
                out.append(sid)
                frag = frag[at + len(piece):]
            if frag:
                out.append(frag)
        fragments = out
    return fragments


# --------------------------------------------------------------------------
# Byte-level BPE
# --------------------------------------------------------------------------

def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def hand_byte_level(md, vocab):
    """A `tokenizers` BPE with the family's own tokenizer.json pipeline."""
    merges = [tuple(m.split(" ", 1)) for m in md["tokenizer.ggml.merges"]]
    tk = Tokenizer(models.BPE(vocab=dict(vocab.ids), merges=merges, fuse_unk=False, byte_fallback=False))
    pre = md.get("tokenizer.ggml.pre")
    if pre == "qwen2":
        tk.normalizer = normalizers.NFC()
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    elif pre == "smollm":
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    else:
        raise SystemExit(f"no hand-built pre-tokenizer for {pre!r}")
    tk.decoder = decoders.ByteLevel()
    add_file_specials(tk, vocab)
    return tk


def add_file_specials(tk, vocab):
    tk.add_special_tokens([AddedToken(vocab.tokens[i], special=True, normalized=False)
                           for i in vocab.of_types(TYPE_CONTROL, TYPE_UNKNOWN)])
    tk.add_tokens([AddedToken(vocab.tokens[i], special=False, normalized=False)
                   for i in vocab.of_types(TYPE_USER_DEFINED)])
    for i in vocab.of_types(TYPE_CONTROL, TYPE_UNKNOWN, TYPE_USER_DEFINED):
        assert tk.token_to_id(vocab.tokens[i]) == i, vocab.tokens[i]


class LlamaCppBpe:
    """llama.cpp's llm_tokenizer_bpe for the "qwen2" and "smollm" pre-tokenizers."""

    def __init__(self, md, vocab):
        self.vocab = vocab
        self.ranks = {tuple(m.split(" ", 1)): r for r, m in enumerate(md["tokenizer.ggml.merges"])}
        pre = md.get("tokenizer.ggml.pre")
        self.regexes = {"qwen2": [LLAMACPP_QWEN2], "smollm": [r"\p{N}", LLAMACPP_GPT2]}[pre]
        self.regexes = [regex.compile(r) for r in self.regexes]
        self.byte_map = bytes_to_unicode()

    def split(self, text):
        """unicode_regex_split: each regex splits every piece further; matches and the
        text between them are both pieces."""
        pieces = [text]
        for rx in self.regexes:
            out = []
            for piece in pieces:
                last = 0
                for m in rx.finditer(piece):
                    if m.start() > last:
                        out.append(piece[last:m.start()])
                    if m.end() > m.start():
                        out.append(m.group())
                    last = m.end()
                if last < len(piece):
                    out.append(piece[last:])
            pieces = out
        return pieces

    def bpe(self, word):
        symbols = list(word)
        while len(symbols) > 1:
            ranked = [(self.ranks.get((a, b)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:]))]
            ranked = [(r, i) for r, i in ranked if r is not None]
            if not ranked:
                break
            _, i = min(ranked)
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        ids = []
        for s in symbols:
            if s in self.vocab.ids:
                ids.append(self.vocab.ids[s])
            else:
                ids.extend(self.vocab.ids[c] for c in s)
        return ids

    def encode(self, text):
        ids = []
        for frag in special_partition(self.vocab, text):
            if isinstance(frag, int):
                ids.append(frag)
                continue
            for word in self.split(frag):
                ids.extend(self.bpe("".join(self.byte_map[b] for b in word.encode("utf-8"))))
        return ids


# --------------------------------------------------------------------------
# SentencePiece (llama.cpp's SPM)
# --------------------------------------------------------------------------

class LlamaCppSpm:
    def __init__(self, md, vocab):
        self.vocab = vocab
        self.scores = [float(s) for s in md["tokenizer.ggml.scores"]]

    def tokenize(self, text, out):
        import heapq
        data = text.encode("utf-8")
        # symbols: [start, length, prev, next] over the UTF-8 bytes, one per character
        syms = []
        pos = 0
        for ch in text:
            n = len(ch.encode("utf-8"))
            syms.append([pos, n, len(syms) - 1, len(syms) + 1])
            pos += n
        if syms:
            syms[-1][3] = -1
        heap, rev_merge = [], {}

        def add_bigram(left, right):
            if left == -1 or right == -1:
                return
            piece = data[syms[left][0]:syms[left][0] + syms[left][1] + syms[right][1]].decode("utf-8")
            tid = self.vocab.ids.get(piece)
            if tid is None:
                return
            # best score first, then the leftmost
            heapq.heappush(heap, (-self.scores[tid], left, right, len(piece.encode("utf-8"))))
            rev_merge[piece] = (left, right)

        for i in range(1, len(syms)):
            add_bigram(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            ls, rs = syms[left], syms[right]
            if ls[1] == 0 or rs[1] == 0 or ls[1] + rs[1] != size:
                continue
            ls[1] += rs[1]
            rs[1] = 0
            ls[3] = rs[3]
            if rs[3] >= 0:
                syms[rs[3]][2] = left
            add_bigram(ls[2], left)
            add_bigram(left, ls[3])

        def resegment(i):
            start, n = syms[i][0], syms[i][1]
            piece = data[start:start + n].decode("utf-8")
            tid = self.vocab.ids.get(piece)
            if tid is not None:
                out.append(tid)
            elif piece in rev_merge:
                a, b = rev_merge[piece]
                resegment(a)
                resegment(b)
            else:
                out.extend(self.vocab.ids[f"<0x{byte:02X}>"] for byte in data[start:start + n])

        i = 0 if syms else -1
        while i != -1:
            resegment(i)
            i = syms[i][3]

    def encode(self, text):
        ids = []
        prev_special = True
        for frag in special_partition(self.vocab, text):
            if isinstance(frag, int):
                ids.append(frag)
                prev_special = True
                continue
            if self.vocab.add_space_prefix and prev_special:
                frag = " " + frag
            self.tokenize(frag.replace(" ", "\u2581"), ids)
            prev_special = False
        return ids


# --------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------

def transformers_tokenizer(md):
    names = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tokenizer_dict = {name: md[f"tokenizer.{key}"] for key, name in names.items() if f"tokenizer.{key}" in md}
    backend, _ = convert_gguf_tokenizer(md["general.architecture"], tokenizer_dict)
    return backend


def render(template, messages, add_generation_prompt, vocab):
    special = lambda i: vocab.tokens[int(i)] if i is not None else ""
    rendered, _ = render_jinja_template(
        conversations=[[{"role": r, "content": c} for r, c in messages]],
        chat_template=template,
        add_generation_prompt=add_generation_prompt,
        bos_token=special(vocab.bos),
        eos_token=special(vocab.eos),
    )
    return rendered[0]


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------

def reference_ids(kind, refs, text, disagreements, model):
    """Every reference's ids for `text`; the recorded ids when they differ."""
    ids = {name: enc(text) for name, enc in refs.items()}
    first = next(iter(ids.values()))
    if all(v == first for v in ids.values()):
        return first, None
    primary = "hand" if kind == "gpt2" else "llama.cpp"
    disagreements.append({"model": model, "text": text, **ids})
    return ids[primary], ids


def build_model(path):
    md = read_metadata(path)
    vocab = Vocab(md)
    kind = md["tokenizer.ggml.model"]
    backend = transformers_tokenizer(md)
    tf_encode = lambda text: backend.encode(text, add_special_tokens=False).ids
    if kind == "gpt2":
        hand = hand_byte_level(md, vocab)
        refs = {
            "hand": lambda text: hand.encode(text, add_special_tokens=False).ids,
            "transformers": tf_encode,
            "llama.cpp": LlamaCppBpe(md, vocab).encode,
        }
        decoder = hand
    elif kind == "llama":
        refs = {"transformers": tf_encode, "llama.cpp": LlamaCppSpm(md, vocab).encode}
        decoder = backend
    else:
        raise SystemExit(f"{path}: tokenizer type {kind!r}")
    return md, vocab, kind, refs, decoder


def fnv1a64(ids):
    """FNV-1a, 64 bits, over the ids as little-endian u32 bytes."""
    h = 0xCBF29CE484222325
    for i in ids:
        for byte in int(i).to_bytes(4, "little"):
            h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def long_text_entry(kind, refs, text_name, root, rel, disagreements, model):
    with open(os.path.join(root, rel), encoding="utf-8") as fh:
        text = fh.read()
    ids = {name: enc(text) for name, enc in refs.items()}
    primary = "hand" if kind == "gpt2" else "llama.cpp"
    agree = {name for name, v in ids.items() if v == ids[primary]}
    if len(agree) != len(ids):
        first = {name: next((k for k, (a, b) in enumerate(zip(v, ids[primary])) if a != b), min(len(v), len(ids[primary])))
                 for name, v in ids.items() if name not in agree}
        disagreements.append({"model": model, "text": text_name, "first_difference": first})
    chosen = ids[primary]
    return {
        "name": text_name,
        "path": rel,
        "n_ids": len(chosen),
        "block": HASH_BLOCK,
        "block_fnv1a64": [fnv1a64(chosen[k:k + HASH_BLOCK]) for k in range(0, len(chosen), HASH_BLOCK)],
        "first_ids": chosen[:32],
        "agreeing_references": sorted(agree),
    }


def model_entry(name, path, disagreements, root):
    md, vocab, kind, refs, decoder = build_model(path)
    cases = []
    for text in CASES:
        ids, by_reference = reference_ids(kind, refs, text, disagreements, name)
        case = {
            "text": text,
            "ids": ids,
            "tokens": [vocab.tokens[i] for i in ids],
            "decoded": decoder.decode(ids, skip_special_tokens=True),
        }
        if by_reference:
            case["by_reference"] = by_reference
        cases.append(case)

    template = md.get("tokenizer.chat_template")
    template_source = "file"
    if template is None and name.startswith("gemma"):
        template, template_source = GEMMA3_TEMPLATE, "gemma3-instruct"
    chats = []
    if template is not None:
        refused = GEMMA_REFUSED if template_source == "gemma3-instruct" else []
        for messages, add_gen in CONVERSATIONS + refused:
            chat = {"messages": [list(m) for m in messages], "add_generation_prompt": add_gen}
            try:
                text = render(template, messages, add_gen, vocab)
            except jinja2.exceptions.TemplateError as e:
                chat["error"] = str(e)
            else:
                ids, by_reference = reference_ids(kind, refs, text, disagreements, name)
                chat.update(text=text, ids=ids)
                if by_reference:
                    chat["by_reference"] = by_reference
            chats.append(chat)

    long_texts = [long_text_entry(kind, refs, text_name, root, rel, disagreements, name)
                  for text_name, rel in LONG_TEXTS]

    entry = {
        "file": os.path.basename(path),
        "tokenizer_model": kind,
        "pre": md.get("tokenizer.ggml.pre"),
        "vocab_size": len(vocab.tokens),
        "bos": vocab.bos,
        "eos": vocab.eos,
        "add_bos": vocab.add_bos,
        "add_space_prefix": vocab.add_space_prefix,
        "end_of_generation": vocab.end_of_generation(),
        "references": list(refs),
        "cases": cases,
        "long_texts": long_texts,
        "chat_template": template_source if template is not None else None,
        "chats": chats,
    }
    if template_source == "gemma3-instruct":
        entry["chat_template_text"] = template
    return entry


def versions():
    names = ["gguf", "tokenizers", "transformers", "jinja2", "regex", "numpy"]
    return {"python": platform.python_version(), **{n: version(n) for n in names}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_cache = os.environ.get("TANDEM_CACHE", os.path.expanduser("~/.cache/tandem"))
    ap.add_argument("--cache", default=default_cache)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "fixtures",
                                                  "tokenizer_reference.json"))
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = ap.parse_args()

    root = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
    disagreements = []
    out = {"versions": versions(), "models": {}, "disagreements": disagreements}
    for name in args.models:
        file = MODELS[name]
        path = os.path.join(args.cache, file)
        if not os.path.exists(path):
            raise SystemExit(f"{path} is missing: run scripts/fetch-model.sh {name}")
        start = time.time()
        out["models"][name] = model_entry(name, path, disagreements, root)
        print(f"{name}: {len(out['models'][name]['cases'])} cases, "
              f"{len(out['models'][name]['chats'])} chats, {time.time() - start:.1f} s", file=sys.stderr)
    for d in disagreements:
        print(f"references disagree on {d['model']} {d['text']!r}", file=sys.stderr)
    with open(args.out, "w", encoding="utf-8") as fh:
        json.dump(out, fh, ensure_ascii=False, indent=1)
        fh.write("\n")
    print(f"wrote {os.path.normpath(args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
