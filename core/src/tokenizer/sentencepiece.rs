//! SentencePiece BPE over a GGUF vocabulary (`tokenizer.ggml.model =
//! llama`), without building merge tables.
//!
//! GGUF stores SentencePiece's pieces and scores, not merges. A pair of
//! adjacent pieces merges when their joined text is a normal piece of the
//! vocabulary; the pair whose piece ranks first merges first. The rank of a
//! pair is the key `(score descending, piece id, left id, right id)`, the
//! order in which `merges` lists the same merges for the `tokenizers` BPE
//! model that [`SentencePieceBpe::to_bpe`] writes, so both give the same
//! tokens. Equal keys (the same pair at several places) merge leftmost first,
//! as that model's queue does.
//!
//! Why not that model itself: it keeps the vocabulary twice (text → id and
//! id → text) and a map of every merge, three hash tables of 17 MB each for
//! Gemma 3's 262,144 pieces, plus an owned string per piece and entry. Here
//! the pieces are one buffer with offsets and one table of ids hashed by
//! text, about 7 MB, and the merges are looked up as they are met.

use std::cmp::Reverse;
use std::collections::hash_map::DefaultHasher;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasher, BuildHasherDefault};
use std::sync::Arc;

use hashbrown::HashTable;
use tokenizers::models::bpe::{Merges, Vocab as BpeVocab, BPE};
use tokenizers::Token;

use crate::{Error, Result};

/// The vocabulary, shared by clones.
#[derive(Clone)]
pub(super) struct SentencePieceBpe {
    pieces: Arc<Pieces>,
}

struct Pieces {
    /// Every piece's text, one after the other.
    text: String,
    /// Piece `id` is `text[starts[id]..starts[id + 1]]`.
    starts: Vec<u32>,
    /// The first element of each piece's merge rank: its score, mapped so
    /// that a higher score is a smaller key.
    rank_keys: Vec<u32>,
    /// Whether a merge may make the piece (normal pieces only: control and
    /// byte tokens never come out of text).
    mergeable: Vec<bool>,
    /// Piece ids hashed by their text.
    ids: HashTable<u32>,
    hasher: BuildHasherDefault<DefaultHasher>,
    /// The `<0xNN>` token of each byte, where the vocabulary has it.
    byte_tokens: [Option<u32>; 256],
    unk: Option<u32>,
}

/// A symbol of the text being merged: a piece and where it lies.
#[derive(Clone, Copy)]
struct Symbol {
    id: u32,
    /// Bytes of the text it covers; 0 once merged into its left neighbour.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A pair waiting to merge: its rank, where its left symbol is, and the
/// piece it makes. Smaller is first.
type Candidate = Reverse<([u32; 4], usize, u32)>;

impl SentencePieceBpe {
    /// The vocabulary of `pieces` (ids in order) with their `scores`;
    /// `mergeable[id]` says which a merge may make. Fails on a piece listed
    /// twice, naming it.
    pub(super) fn new(
        pieces: &[String],
        scores: &[f32],
        mergeable: Vec<bool>,
        unk: Option<u32>,
    ) -> std::result::Result<Self, String> {
        let mut text = String::with_capacity(pieces.iter().map(String::len).sum());
        let mut starts = Vec::with_capacity(pieces.len() + 1);
        for piece in pieces {
            starts.push(text.len() as u32);
            text.push_str(piece);
        }
        starts.push(text.len() as u32);
        let hasher = BuildHasherDefault::<DefaultHasher>::default();
        let mut ids = HashTable::with_capacity(pieces.len());
        for (id, piece) in pieces.iter().enumerate() {
            let hash = hasher.hash_one(piece.as_str());
            let found = ids.find(hash, |&other: &u32| pieces[other as usize] == *piece);
            if let Some(&first) = found {
                return Err(format!("duplicate token {piece:?} (ids {first} and {id})"));
            }
            ids.insert_unique(hash, id as u32, |&other| {
                hasher.hash_one(pieces[other as usize].as_str())
            });
        }
        let mut byte_tokens = [None; 256];
        for (byte, slot) in byte_tokens.iter_mut().enumerate() {
            let code = format!("<0x{byte:02X}>");
            let hash = hasher.hash_one(code.as_str());
            *slot = ids.find(hash, |&id| pieces[id as usize] == code).copied();
        }
        let rank_keys = scores[..pieces.len()]
            .iter()
            .map(|&s| !ordered_bits(s))
            .collect();
        Ok(Self {
            pieces: Arc::new(Pieces {
                text,
                starts,
                rank_keys,
                mergeable,
                ids,
                hasher,
                byte_tokens,
                unk,
            }),
        })
    }

    pub(super) fn len(&self) -> usize {
        self.pieces.starts.len() - 1
    }

    pub(super) fn piece(&self, id: u32) -> Option<&str> {
        self.pieces.piece(id)
    }

    pub(super) fn id(&self, text: &str) -> Option<u32> {
        self.pieces.id(text)
    }

    /// The pieces of `text` (already normalised: `▁` for spaces), with the
    /// byte offsets each covers.
    pub(super) fn tokenize(&self, text: &str) -> Vec<Token> {
        let p = &*self.pieces;
        let mut symbols = p.initial_symbols(text);
        p.merge(&mut symbols);
        let mut start = 0;
        symbols
            .iter()
            .filter(|s| s.len > 0)
            .map(|s| {
                let offsets = (start, start + s.len);
                start += s.len;
                let value = p.piece(s.id).unwrap_or_default().to_string();
                Token::new(s.id, value, offsets)
            })
            .collect()
    }

    /// Every piece and its id.
    pub(super) fn vocab(&self) -> HashMap<String, u32> {
        (0..self.len() as u32)
            .filter_map(|id| Some((self.piece(id)?.to_string(), id)))
            .collect()
    }

    /// The same tokenizer as a `tokenizers` BPE model with its merges listed
    /// (for writing `tokenizer.json`; far larger in memory than this one).
    pub(super) fn to_bpe(&self) -> Result<BPE> {
        let mut bpe = BPE::builder()
            .vocab_and_merges(
                self.vocab().into_iter().collect::<BpeVocab>(),
                self.merges(),
            )
            .byte_fallback(true)
            .fuse_unk(true);
        if let Some(unk) = self.pieces.unk.and_then(|id| self.piece(id)) {
            bpe = bpe.unk_token(unk.to_string());
        }
        bpe.build()
            .map_err(|e| Error::Tokenizer(format!("SentencePiece vocabulary as BPE: {e}")))
    }

    /// Every merge, in rank order: each mergeable piece split in two
    /// pieces of the vocabulary, at every character boundary.
    fn merges(&self) -> Merges {
        let p = &*self.pieces;
        let mut ranked = Vec::new();
        for id in 0..self.len() as u32 {
            let Some(piece) = p.piece(id).filter(|_| p.mergeable[id as usize]) else {
                continue;
            };
            for (at, _) in piece.char_indices().skip(1) {
                let (left, right) = piece.split_at(at);
                if let (Some(l), Some(r)) = (p.id(left), p.id(right)) {
                    ranked.push([p.rank_keys[id as usize], id, l, r]);
                }
            }
        }
        ranked.sort_unstable();
        let text = |id: u32| p.piece(id).unwrap_or_default().to_string();
        ranked
            .into_iter()
            .map(|[_, _, l, r]| (text(l), text(r)))
            .collect()
    }
}

impl Pieces {
    fn piece(&self, id: u32) -> Option<&str> {
        let id = id as usize;
        let (start, end) = (*self.starts.get(id)?, *self.starts.get(id + 1)?);
        Some(&self.text[start as usize..end as usize])
    }

    fn id(&self, text: &str) -> Option<u32> {
        let hash = self.hasher.hash_one(text);
        self.ids
            .find(hash, |&id| self.piece(id) == Some(text))
            .copied()
    }

    /// One symbol per character: its piece, else its bytes' `<0xNN>` pieces,
    /// else the unknown piece (a run of unknown characters is one), else
    /// nothing.
    fn initial_symbols(&self, text: &str) -> Vec<Symbol> {
        let mut ids: Vec<(u32, usize)> = Vec::with_capacity(text.len());
        let mut unknown: Option<(u32, usize)> = None;
        for (at, c) in text.char_indices() {
            let ch = &text[at..at + c.len_utf8()];
            if let Some(id) = self.id(ch) {
                ids.extend(unknown.take());
                ids.push((id, ch.len()));
                continue;
            }
            let bytes: Option<Vec<u32>> =
                ch.bytes().map(|b| self.byte_tokens[b as usize]).collect();
            if let Some(bytes) = bytes {
                ids.extend(bytes.into_iter().map(|id| (id, 1)));
                continue;
            }
            if let Some(unk) = self.unk {
                let (_, len) = unknown.get_or_insert((unk, 0));
                *len += ch.len();
            }
        }
        ids.extend(unknown);
        let last = ids.len().saturating_sub(1);
        ids.into_iter()
            .enumerate()
            .map(|(i, (id, len))| Symbol {
                id,
                len,
                prev: i.checked_sub(1),
                next: (i < last).then_some(i + 1),
            })
            .collect()
    }

    /// The rank of merging `left` and `right` and the piece it makes, if
    /// their joined text is a mergeable piece.
    fn pair(&self, left: u32, right: u32, joined: &mut String) -> Option<([u32; 4], u32)> {
        joined.clear();
        joined.push_str(self.piece(left)?);
        joined.push_str(self.piece(right)?);
        let id = self.id(joined)?;
        self.mergeable[id as usize].then_some(([self.rank_keys[id as usize], id, left, right], id))
    }

    /// Merges pairs, first-ranked first, until none is left.
    fn merge(&self, symbols: &mut [Symbol]) {
        let mut joined = String::new();
        let mut queue: BinaryHeap<Candidate> = BinaryHeap::with_capacity(symbols.len());
        let mut push = |queue: &mut BinaryHeap<Candidate>, at: usize, symbols: &[Symbol]| {
            if let Some(next) = symbols[at].next {
                if let Some((rank, id)) = self.pair(symbols[at].id, symbols[next].id, &mut joined) {
                    queue.push(Reverse((rank, at, id)));
                }
            }
        };
        for at in 0..symbols.len() {
            push(&mut queue, at, symbols);
        }
        while let Some(Reverse(([_, made, left, right], at, _))) = queue.pop() {
            // Entries go stale when a neighbour merged first.
            let current = symbols[at];
            let Some(next) = current.next.filter(|_| current.len > 0) else {
                continue;
            };
            if current.id != left || symbols[next].id != right {
                continue;
            }
            let removed = symbols[next];
            symbols[next].len = 0;
            symbols[at] = Symbol {
                id: made,
                len: current.len + removed.len,
                next: removed.next,
                ..current
            };
            if let Some(after) = removed.next {
                symbols[after].prev = Some(at);
            }
            if let Some(prev) = current.prev {
                push(&mut queue, prev, symbols);
            }
            push(&mut queue, at, symbols);
        }
    }
}

/// `x`'s bits as an unsigned integer in `f32::total_cmp`'s order.
fn ordered_bits(x: f32) -> u32 {
    let bits = x.to_bits();
    if bits >> 31 == 1 {
        !bits
    } else {
        bits | 1 << 31
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use tokenizers::Model;

    use super::*;

    /// Characters of the test vocabularies: ASCII, `▁`, two and four bytes.
    const ALPHABET: [&str; 6] = ["a", "b", "c", "▁", "é", "🙂"];

    /// A vocabulary of `<unk>`, some byte tokens, single characters and
    /// joined pieces, with scores drawn from few values (ties on purpose).
    fn vocabulary(
        singles: Vec<bool>,
        joined: Vec<(Vec<usize>, i8, bool)>,
        bytes: Vec<u8>,
    ) -> (Vec<String>, Vec<f32>, Vec<bool>) {
        let mut pieces = vec!["<unk>".to_string()];
        let mut scores = vec![0.0];
        let mut mergeable = vec![false];
        for byte in bytes {
            let code = format!("<0x{byte:02X}>");
            if !pieces.contains(&code) {
                pieces.push(code);
                scores.push(0.0);
                mergeable.push(false);
            }
        }
        for (c, _) in ALPHABET.iter().zip(singles).filter(|(_, keep)| *keep) {
            pieces.push(c.to_string());
            scores.push(-100.0);
            mergeable.push(true);
        }
        for (chars, score, normal) in joined {
            let piece: String = chars.iter().map(|&c| ALPHABET[c]).collect();
            if !pieces.contains(&piece) {
                pieces.push(piece);
                scores.push(f32::from(score % 4));
                mergeable.push(normal);
            }
        }
        (pieces, scores, mergeable)
    }

    fn ids(tokens: &[Token]) -> Vec<(u32, (usize, usize))> {
        tokens.iter().map(|t| (t.id, t.offsets)).collect()
    }

    #[test]
    fn merges_the_first_ranked_pair_first() {
        let pieces = ["<unk>", "a", "b", "c", "ab", "bc", "abc"].map(String::from);
        // "bc" outranks "ab": "abc" comes from "a" + "bc".
        let scores = [0.0, -9.0, -9.0, -9.0, -2.0, -1.0, -3.0];
        let model = SentencePieceBpe::new(&pieces, &scores, vec![true; 7], Some(0)).unwrap();
        let got: Vec<u32> = model.tokenize("abcab").iter().map(|t| t.id).collect();
        assert_eq!(got, [6, 4]);
        let offsets: Vec<_> = model.tokenize("abcab").iter().map(|t| t.offsets).collect();
        assert_eq!(offsets, [(0, 3), (3, 5)]);
    }

    #[test]
    fn unknown_characters_fall_back_to_bytes_then_unk() {
        let mut pieces: Vec<String> = ["<unk>", "a"].map(String::from).to_vec();
        pieces.extend(["<0xC3>", "<0xA9>"].map(String::from));
        let model =
            SentencePieceBpe::new(&pieces, &[0.0; 4], vec![false, true, false, false], Some(0))
                .unwrap();
        let got: Vec<u32> = model.tokenize("aé🙂🙂a").iter().map(|t| t.id).collect();
        // é has its bytes; a run of 🙂 (no byte tokens) is one <unk>.
        assert_eq!(got, [1, 2, 3, 0, 1]);
    }

    #[test]
    fn a_piece_listed_twice_is_an_error() {
        let pieces = ["<unk>", "a", "a"].map(String::from);
        let err = SentencePieceBpe::new(&pieces, &[0.0; 3], vec![true; 3], Some(0))
            .err()
            .unwrap();
        assert!(err.contains("duplicate token \"a\" (ids 1 and 2)"), "{err}");
    }

    proptest! {
        /// The same tokens and offsets as the `tokenizers` BPE model with the
        /// merges listed in rank order (what Tandem ran before, and what
        /// `tokenizer.json` holds).
        #[test]
        fn tokenizes_as_the_bpe_model_of_its_merges(
            singles in prop::collection::vec(prop::bool::weighted(0.8), ALPHABET.len()),
            joined in prop::collection::vec(
                (prop::collection::vec(0..ALPHABET.len(), 2..5), any::<i8>(), prop::bool::weighted(0.9)),
                0..40,
            ),
            bytes in prop::collection::vec(prop_oneof![Just(0xC3u8), Just(0xA9), Just(0xF0), Just(0x9F), Just(0x99), Just(0x82)], 0..6),
            with_unk in any::<bool>(),
            text in prop::collection::vec(0..ALPHABET.len(), 0..40),
        ) {
            let (pieces, scores, mergeable) = vocabulary(singles, joined, bytes);
            let unk = with_unk.then_some(0);
            let model = SentencePieceBpe::new(&pieces, &scores, mergeable, unk).unwrap();
            let bpe = model.to_bpe().unwrap();
            let text: String = text.iter().map(|&c| ALPHABET[c]).collect();
            let expected = match text.is_empty() {
                true => Vec::new(),
                false => bpe.tokenize(&text).unwrap(),
            };
            prop_assert_eq!(ids(&model.tokenize(&text)), ids(&expected), "{:?} over {:?}", text, pieces);
        }
    }
}
