"""Tokenizers built from a GGUF file's metadata, for the reference fixtures.

Two independent encodings per vocabulary kind, checked against each other
(`cross_check`) on the prompts and on the perplexity text:

* `tokenizer.ggml.model = gpt2` (byte-level BPE: SmolLM2, Qwen2): HuggingFace
  `tokenizers` BPE from the GGUF vocab/merges with the pre-tokenizer that
  llama.cpp uses for `tokenizer.ggml.pre` (src/llama-vocab.cpp:
  "smollm" = each \\p{N} alone then the GPT-2 regex; "qwen2" = Qwen2's regex),
  against a small pure-Python byte-level BPE with the same regexes;
* `tokenizer.ggml.model = llama` (SentencePiece BPE: Gemma 3): a pure-Python
  port of llama.cpp's `llm_tokenizer_spm_session` (spaces escaped to U+2581,
  no space prefix when `tokenizer.ggml.add_space_prefix` is false, merges of
  the adjacent pair whose merged piece has the highest score, leftmost first,
  pieces not in the vocab as <0xXX> byte tokens), against a `tokenizers` BPE
  with byte fallback whose merges are ranked by the merged piece's score (as
  transformers' GGUF converter builds it).

Both follow llama.cpp's `tokenizer_st_partition`: the text is first split on
the vocabulary's USER_DEFINED tokens (always) and CONTROL tokens (only when
`parse_special`, as llama.cpp's prompt tokenization does; `llama-perplexity`
tokenizes without it), longest token first; the raw pieces in between are
encoded separately. BOS is prepended when `add_special` and
`tokenizer.ggml.add_bos_token` ask for it.
"""
import heapq

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# llama_token_type in GGUF
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
QWEN2_REGEX = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split every \p{N} first, regex)
BPE_PRE = {"smollm": (True, GPT2_REGEX), "qwen2": (False, QWEN2_REGEX)}


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def bytes_to_unicode():
    """GPT-2's byte -> printable character map."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) \
        + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


class GgufTokenizer:
    """What both vocabulary kinds share: special-token partition, BOS, stop ids, decode."""

    def __init__(self, reader):
        self.tokens = list(_field(reader, "tokenizer.ggml.tokens"))
        self.types = [int(t) for t in _field(reader, "tokenizer.ggml.token_type")]
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
        self.bos = _field(reader, "tokenizer.ggml.bos_token_id")
        eos = _field(reader, "tokenizer.ggml.eos_token_id")
        stops = {eos} | {self.vocab[t] for t in ("<|endoftext|>", "<|im_end|>", "<end_of_turn>", "<eos>")
                          if t in self.vocab}
        self.stop_ids = {int(s) for s in stops if s is not None}
        by_length = lambda ids: sorted(ids, key=lambda i: -len(self.tokens[i]))
        self.always_split = by_length(i for i, t in enumerate(self.types) if t == USER_DEFINED)
        self.special_split = by_length(i for i, t in enumerate(self.types)
                                       if t in (USER_DEFINED, CONTROL, UNKNOWN))

    def partition(self, text, parse_special):
        """[str | int]: raw text pieces and special token ids, as tokenizer_st_partition."""
        parts = [text]
        for tid in (self.special_split if parse_special else self.always_split):
            piece = self.tokens[tid]
            if not piece:
                continue
            out = []
            for p in parts:
                if not isinstance(p, str) or piece not in p:
                    out.append(p)
                    continue
                chunks = p.split(piece)
                for k, chunk in enumerate(chunks):
                    if k:
                        out.append(tid)
                    if chunk:
                        out.append(chunk)
            parts = out
        return parts

    def encode(self, text, add_special=True, parse_special=True, raw_encoder=None):
        raw_encoder = raw_encoder or self.encode_raw
        ids = [self.bos] if add_special and self.add_bos else []
        for p in self.partition(text, parse_special):
            ids.extend([p] if isinstance(p, int) else raw_encoder(p))
        return ids

    def encode_cross(self, text, add_special=True, parse_special=True):
        return self.encode(text, add_special, parse_special, raw_encoder=self.encode_raw_cross)

    def cross_check(self, texts, parse_special=True):
        for s in texts:
            a = self.encode(s, parse_special=parse_special)
            b = self.encode_cross(s, parse_special=parse_special)
            assert a == b, f"tokenizers disagree on {s[:80]!r}: {a[:40]} vs {b[:40]}"

    def token(self, i):
        return self.tokens[i]


class ByteLevelBpe(GgufTokenizer):
    def __init__(self, reader, pre):
        super().__init__(reader)
        import regex
        self.split_digits, pattern = BPE_PRE[pre]
        merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
        assert all(len(m) == 2 for m in merges)
        assert len(self.vocab) == len(self.tokens)
        tk = Tokenizer(models.BPE(vocab=self.vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        steps = [pre_tokenizers.Digits(individual_digits=True)] if self.split_digits else []
        if pre == "smollm":
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps += [pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        tk.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tk.decoder = decoders.ByteLevel()
        self.hf = tk
        self.re = regex.compile(pattern)
        self.digit = regex.compile(r"\p{N}")
        self.ranks = {m: r for r, m in enumerate(merges)}
        self.byte_map = bytes_to_unicode()
        self.byte_unmap = {c: b for b, c in self.byte_map.items()}
        self.cache = {}
        self.description = (f"tokenizers BPE from GGUF vocab/merges, pre-tokenizer {pre!r} as llama.cpp "
                            "(" + ("Digits(individual_digits=True), ByteLevel(add_prefix_space=False)"
                                   if pre == "smollm" else "Split(Qwen2 regex), ByteLevel(use_regex=False)")
                            + "); USER_DEFINED tokens always and CONTROL tokens when parsing specials matched "
                            "verbatim first; cross-checked against a pure-Python byte-level BPE")

    def encode_raw(self, text):
        return self.hf.encode(text, add_special_tokens=False).ids

    def _bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        parts = list(word)
        while len(parts) > 1:
            best = None
            for i in range(len(parts) - 1):
                r = self.ranks.get((parts[i], parts[i + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, parts[i], parts[i + 1])
            if best is None:
                break
            _, a, b = best
            out, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            parts = out
        ids = [self.vocab[p] for p in parts]
        self.cache[word] = ids
        return ids

    def encode_raw_cross(self, text):
        pieces = [text]
        if self.split_digits:
            pieces, last = [], 0
            for m in self.digit.finditer(text):
                pieces += [text[last:m.start()], m.group()]
                last = m.end()
            pieces.append(text[last:])
        ids = []
        for piece in pieces:
            for w in self.re.findall(piece):
                ids.extend(self._bpe("".join(self.byte_map[b] for b in w.encode("utf-8"))))
        return ids

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            if self.types[i] != NORMAL:
                out += self.tokens[i].encode("utf-8")
            else:
                out += bytes(self.byte_unmap[c] for c in self.tokens[i])
        return out.decode("utf-8", errors="replace")


class SentencePieceBpe(GgufTokenizer):
    SPACE = "\u2581"

    def __init__(self, reader):
        super().__init__(reader)
        self.scores = [float(s) for s in _field(reader, "tokenizer.ggml.scores")]
        self.add_space_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", True))
        assert not self.add_space_prefix, "space prefix not implemented (Gemma 3 has none)"
        self.byte_ids = {b: self.vocab[f"<0x{b:02X}>"] for b in range(256)}
        self.hf = None
        self.description = ("pure-Python port of llama.cpp's SPM tokenizer (llm_tokenizer_spm_session; "
                            "' ' -> U+2581, no space prefix, highest-score merge first, leftmost on ties, "
                            "byte fallback <0xXX>); USER_DEFINED tokens always and CONTROL tokens when "
                            "parsing specials matched verbatim first; BOS when add_bos_token; cross-checked "
                            "against a tokenizers BPE (byte_fallback) with merges ranked by merged-piece score")

    def encode_raw(self, text):
        if not text:
            return []
        text = text.replace(" ", self.SPACE)
        # symbols: [start, length] of UTF-8 characters, linked left/right
        chars = list(text)
        n = len(chars)
        sym_text = chars[:]
        alive = [True] * n
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap = []
        rev_merge = {}

        def try_add(left, right):
            if left == -1 or right == -1:
                return
            merged = sym_text[left] + sym_text[right]
            tid = self.vocab.get(merged)
            if tid is None:
                return
            # highest score first, then the leftmost pair (llm_bigram_spm::comparator)
            heapq.heappush(heap, (-self.scores[tid], left, right, len(merged)))
            rev_merge[merged] = (sym_text[left], sym_text[right])

        for i in range(1, n):
            try_add(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if not (alive[left] and alive[right]) or len(sym_text[left]) + len(sym_text[right]) != size \
                    or nxt[left] != right:
                continue
            sym_text[left] += sym_text[right]
            alive[right] = False
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            try_add(prev[left], left)
            try_add(left, nxt[left])
        ids = []
        i = 0
        while i != -1:
            self._resegment(sym_text[i], rev_merge, ids)
            i = nxt[i]
        return ids

    def _resegment(self, piece, rev_merge, ids):
        tid = self.vocab.get(piece)
        if tid is not None:
            ids.append(tid)
            return
        split = rev_merge.get(piece)
        if split is None:
            ids.extend(self.byte_ids[b] for b in piece.encode("utf-8"))
            return
        self._resegment(split[0], rev_merge, ids)
        self._resegment(split[1], rev_merge, ids)

    def _hf(self):
        if self.hf is None:
            merges = []
            for tid, piece in enumerate(self.tokens):
                if self.types[tid] in (NORMAL, USER_DEFINED, CONTROL, UNUSED) and len(piece) > 1:
                    for k in range(1, len(piece)):
                        a, b = piece[:k], piece[k:]
                        if a in self.vocab and b in self.vocab:
                            merges.append((-self.scores[tid], tid, k, a, b))
            merges.sort()
            tk = Tokenizer(models.BPE(vocab=self.vocab, merges=[(a, b) for *_, a, b in merges],
                                      byte_fallback=True, fuse_unk=False))
            tk.normalizer = normalizers.Replace(" ", self.SPACE)
            self.hf = tk
        return self.hf

    def encode_raw_cross(self, text):
        return self._hf().encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        out = bytearray()
        for i in ids:
            if self.types[i] == BYTE:
                out.append(int(self.tokens[i][3:5], 16))
            else:
                out += self.tokens[i].replace(self.SPACE, " ").encode("utf-8")
        return out.decode("utf-8", errors="replace")


def for_gguf(reader):
    kind = _field(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        pre = _field(reader, "tokenizer.ggml.pre")
        if pre not in BPE_PRE:
            raise SystemExit(f"tokenizer.ggml.pre {pre!r} not implemented")
        return ByteLevelBpe(reader, pre)
    if kind == "llama":
        return SentencePieceBpe(reader)
    raise SystemExit(f"tokenizer.ggml.model {kind!r} not implemented")
