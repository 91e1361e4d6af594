//! Building a tokenizer from GGUF metadata, reading the `tokenizer.ggml.*` keys as
//! llama.cpp does (`src/llama-vocab.cpp`), so a GGUF file tokenizes here as it does
//! there and as the Hugging Face tokenizer it was converted from.
//!
//! Two vocabulary kinds are read:
//! - `gpt2`: byte-level BPE with ranked merges; the words are split first by the
//!   regexes llama.cpp picks from `tokenizer.ggml.pre`.
//! - `llama`: SentencePiece BPE. GGUF stores scores, not merges; as llama.cpp
//!   (and transformers' GGUF loader) do, a pair of pieces merges when the joined
//!   piece is in the vocabulary, higher-scored pieces first. Characters missing
//!   from the vocabulary fall back to `<0xNN>` byte tokens, and spaces become `▁`.
//!
//! Control and unknown tokens become special added tokens and user-defined ones
//! plain added tokens, so both are matched whole in the text before the model runs.

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Merges, Vocab as BpeVocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PreTokenizerWrapper,
    SplitDelimiterBehavior,
};

use super::sentencepiece::SentencePieceBpe;
use super::token_model::{Pipeline, TokenModel};
use super::{SpecialTokens, Tokenizer};
use crate::model::gguf::{GgufArray, GgufFile, GgufValue};
use crate::{Error, Result};

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_SCORES: &str = "tokenizer.ggml.scores";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_BOS_ID: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS_ID: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT_ID: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM_ID: &str = "tokenizer.ggml.eom_token_id";
const KEY_UNK_ID: &str = "tokenizer.ggml.unknown_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// Texts of control tokens that end a chat turn. Many files name only the EOS
/// token in their metadata, so, like llama.cpp, generation also stops on these.
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<｜end▁of▁sentence｜>",
];

/// GPT-2's word split, the `ByteLevel` pre-tokenizer's own regex.
const GPT2_WORDS: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's word split (numbers in groups of up to three digits).
const LLAMA3_WORDS: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's word split: Llama 3's with single digits.
const QWEN2_WORDS: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Every digit on its own, before the GPT-2 split (StarCoder, SmolLM).
const SINGLE_DIGITS: &str = r"\p{N}";

/// llama.cpp's token types (`tokenizer.ggml.token_type`), as far as building the tokenizer cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    /// Unused, byte (`<0xNN>`) and undefined tokens: ordinary vocabulary entries.
    Other,
}

impl TokenType {
    fn from_gguf(value: usize) -> TokenType {
        match value {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            _ => TokenType::Other,
        }
    }
}

/// The token list of the file, with each token's type.
struct GgufVocab {
    tokens: Vec<String>,
    types: Vec<TokenType>,
}

/// The part of the tokenizer that depends on `tokenizer.ggml.model`.
struct ModelTokenizer {
    inner: Pipeline,
    kind: String,
    /// Whether prompts start with BOS when the file has no `tokenizer.ggml.add_bos_token`.
    add_bos_default: bool,
    /// llama.cpp's BOS and EOS ids for files that name none.
    default_bos: Option<u32>,
    default_eos: Option<u32>,
}

/// How llama.cpp splits text into words before byte-level BPE, for one `tokenizer.ggml.pre` family.
struct WordSplit {
    /// Applied one after the other; both the matches and the text between them become words.
    regexes: &'static [&'static str],
    /// A word that is itself in the vocabulary is one token, merges or not (Llama 3).
    ignore_merges: bool,
    /// The text is put in Unicode NFC first, as the family's own tokenizer.json
    /// does (Qwen2). llama.cpp skips this, so it differs from the model's
    /// tokenizer on decomposed text ("e" + U+0301); Tandem follows the model.
    nfc: bool,
    add_bos: bool,
}

const GPT2_SPLIT: WordSplit = WordSplit {
    regexes: &[GPT2_WORDS],
    ignore_merges: false,
    nfc: false,
    add_bos: false,
};

pub(super) fn tokenizer_from_gguf(file: &GgufFile) -> Result<Tokenizer> {
    let vocab = read_vocab(file)?;
    let model = get_str(file, KEY_MODEL)?.ok_or_else(|| {
        Error::Tokenizer(format!(
            "model file has no tokenizer type ({KEY_MODEL} missing)"
        ))
    })?;
    let built = match model {
        "gpt2" => byte_level_bpe(file, &vocab)?,
        "llama" => sentencepiece_bpe(file, &vocab)?,
        other => {
            return Err(Error::Unsupported(format!(
                "tokenizer type '{other}' ({KEY_MODEL}); Tandem reads 'gpt2' (byte-level BPE) \
                 and 'llama' (SentencePiece)"
            )))
        }
    };
    let mut inner = built.inner;
    add_special_vocab(&mut inner, &vocab);

    let id = |key| special_id(file, key, vocab.tokens.len());
    let bos = id(KEY_BOS_ID)?.or(built.default_bos);
    let mut eos: Vec<u32> = [
        id(KEY_EOS_ID)?.or(built.default_eos),
        id(KEY_EOT_ID)?,
        id(KEY_EOM_ID)?,
    ]
    .into_iter()
    .flatten()
    .collect();
    eos.extend(end_of_turn_tokens(&vocab));
    let add_bos = get_bool(file, KEY_ADD_BOS)?.unwrap_or(built.add_bos_default);
    let chat_template = get_str(file, KEY_CHAT_TEMPLATE)?.map(str::to_string);

    Tokenizer::assemble(
        inner,
        built.kind,
        SpecialTokens { bos, eos, add_bos },
        chat_template,
    )
}

fn read_vocab(file: &GgufFile) -> Result<GgufVocab> {
    let tokens = string_array(file, KEY_TOKENS)?.ok_or_else(|| {
        Error::Tokenizer(format!(
            "model file has no tokenizer ({KEY_TOKENS} missing)"
        ))
    })?;
    // llama.cpp renames empty tokens the same way, so they cannot collide.
    let tokens: Vec<String> = tokens
        .iter()
        .enumerate()
        .map(|(id, text)| {
            if text.is_empty() {
                format!("[EMPTY_{id}]")
            } else {
                text.to_string()
            }
        })
        .collect();
    let types = match int_array(file, KEY_TOKEN_TYPE)? {
        Some(types) if types.len() < tokens.len() => {
            return Err(Error::Tokenizer(format!(
                "{KEY_TOKEN_TYPE} has {} entries for {} tokens",
                types.len(),
                tokens.len()
            )))
        }
        Some(types) => types.into_iter().map(TokenType::from_gguf).collect(),
        None => vec![TokenType::Normal; tokens.len()],
    };
    Ok(GgufVocab { tokens, types })
}

impl GgufVocab {
    /// Token text → id, as the BPE model wants it.
    fn bpe_vocab(&self) -> Result<BpeVocab> {
        let mut ids = BpeVocab::default();
        for (id, text) in self.tokens.iter().enumerate() {
            if let Some(first) = ids.insert(text.clone(), id as u32) {
                return Err(Error::Tokenizer(format!(
                    "duplicate token {text:?} in {KEY_TOKENS} (ids {first} and {id})"
                )));
            }
        }
        Ok(ids)
    }
}

fn byte_level_bpe(file: &GgufFile, vocab: &GgufVocab) -> Result<ModelTokenizer> {
    let merges = string_array(file, KEY_MERGES)?.ok_or_else(|| {
        Error::Tokenizer(format!(
            "byte-level BPE tokenizer without merges ({KEY_MERGES} missing)"
        ))
    })?;
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, merge)| {
            split_merge(merge).ok_or_else(|| {
                Error::Tokenizer(format!("{KEY_MERGES}[{i}] = {merge:?} is not two tokens"))
            })
        })
        .collect::<Result<Merges>>()?;

    let pre = get_str(file, KEY_PRE)?;
    let known = pre.and_then(|name| Some((name, word_split(name)?)));
    let (split, pre_description) = match known {
        Some((name, split)) => (split, format!("pre-tokenizer {name}")),
        None => {
            let named = match pre {
                Some(name) => format!("unknown pre-tokenizer '{name}'"),
                None => "no pre-tokenizer".to_string(),
            };
            eprintln!(
                "warning: {named} ({KEY_PRE}); words are split as GPT-2 does, \
                 so tokens may differ from the model's own tokenizer"
            );
            (GPT2_SPLIT, format!("{named}, GPT-2 split used"))
        }
    };

    let bpe = BPE::builder()
        .vocab_and_merges(vocab.bpe_vocab()?, merges)
        .ignore_merges(split.ignore_merges)
        .build()
        .map_err(|e| Error::Tokenizer(format!("byte-level BPE vocabulary: {e}")))?;
    let mut inner = Pipeline::new(TokenModel::from(ModelWrapper::from(bpe)));
    if split.nfc {
        inner.with_normalizer(Some(NFC));
    }
    inner.with_pre_tokenizer(Some(byte_level_pre_tokenizer(&split)?));
    inner.with_decoder(Some(ByteLevel::default()));
    Ok(ModelTokenizer {
        inner,
        kind: format!("byte-level BPE (GGUF, {pre_description})"),
        add_bos_default: split.add_bos,
        default_bos: None,
        default_eos: None,
    })
}

/// The word split llama.cpp uses for a `tokenizer.ggml.pre` name, if Tandem knows it.
fn word_split(pre: &str) -> Option<WordSplit> {
    let split = match pre {
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => WordSplit {
            regexes: &[LLAMA3_WORDS],
            ignore_merges: true,
            add_bos: true,
            ..GPT2_SPLIT
        },
        "dbrx" | "smaug-bpe" => WordSplit {
            regexes: &[LLAMA3_WORDS],
            ..GPT2_SPLIT
        },
        "qwen2" => WordSplit {
            regexes: &[QWEN2_WORDS],
            nfc: true,
            ..GPT2_SPLIT
        },
        "deepseek-r1-qwen" | "stablelm2" | "megrez" => WordSplit {
            regexes: &[QWEN2_WORDS],
            ..GPT2_SPLIT
        },
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            WordSplit {
                regexes: &[SINGLE_DIGITS, GPT2_WORDS],
                ..GPT2_SPLIT
            }
        }
        "gpt-2" | "default" | "phi-2" | "mpt" | "olmo" | "jais" | "exaone4" | "trillion"
        | "jina-es" | "jina-de" | "jina-v2-es" | "jina-v2-de" => GPT2_SPLIT,
        _ => return None,
    };
    Some(split)
}

fn byte_level_pre_tokenizer(split: &WordSplit) -> Result<PreTokenizerSequence> {
    let mut steps = split
        .regexes
        .iter()
        .map(|regex| {
            Split::new(
                SplitPattern::Regex(regex.to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map(PreTokenizerWrapper::from)
            .map_err(|e| Error::Tokenizer(format!("pre-tokenizer regex {regex:?}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    // The regexes already split the words; ByteLevel only maps bytes to its alphabet.
    steps.push(tokenizers::pre_tokenizers::byte_level::ByteLevel::new(false, true, false).into());
    Ok(PreTokenizerSequence::new(steps))
}

/// Splits a merge `"Ġ t"` at the first space after its first character, as
/// llama.cpp does (a token may itself start with a space).
fn split_merge(merge: &str) -> Option<(String, String)> {
    let first_len = merge.chars().next()?.len_utf8();
    let space = first_len + merge[first_len..].find(' ')?;
    Some((merge[..space].to_string(), merge[space + 1..].to_string()))
}

fn sentencepiece_bpe(file: &GgufFile, vocab: &GgufVocab) -> Result<ModelTokenizer> {
    let scores = float_array(file, KEY_SCORES)?.ok_or_else(|| {
        Error::Tokenizer(format!(
            "SentencePiece tokenizer without scores ({KEY_SCORES} missing); they rank its merges"
        ))
    })?;
    if scores.len() < vocab.tokens.len() {
        return Err(Error::Tokenizer(format!(
            "{KEY_SCORES} has {} entries for {} tokens",
            scores.len(),
            vocab.tokens.len()
        )));
    }
    let token_count = vocab.tokens.len();
    let unk = special_id(file, KEY_UNK_ID, token_count)?.or((token_count > 0).then_some(0));
    let add_space_prefix = get_bool(file, KEY_ADD_SPACE_PREFIX)?.unwrap_or(true);
    let mergeable = vocab
        .types
        .iter()
        .map(|&t| t == TokenType::Normal)
        .collect();
    let model = SentencePieceBpe::new(&vocab.tokens, &scores, mergeable, unk)
        .map_err(|e| Error::Tokenizer(format!("{KEY_TOKENS}: {e}")))?;

    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|e| Error::Tokenizer(format!("replace {from:?}: {e}")))
    };
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    let mut decoders: Vec<DecoderWrapper> = vec![
        replace("▁", " ")?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        // SentencePiece reads " Hello" at the start of every text; the decoder
        // takes that space off again.
        normalizers.push(Prepend::new("▁".to_string()).into());
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    normalizers.push(replace(" ", "▁")?.into());

    let mut inner = Pipeline::new(TokenModel::SentencePiece(model));
    inner.with_normalizer(Some(NormalizerSequence::new(normalizers)));
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(ModelTokenizer {
        inner,
        kind: "SentencePiece BPE (GGUF)".to_string(),
        add_bos_default: true,
        default_bos: (token_count > 1).then_some(1),
        default_eos: (token_count > 2).then_some(2),
    })
}

/// Control and unknown tokens become special added tokens, user-defined ones plain
/// added tokens; both are then found whole in the raw text.
fn add_special_vocab(inner: &mut Pipeline, vocab: &GgufVocab) {
    let mut special = Vec::new();
    let mut user_defined = Vec::new();
    for (text, kind) in vocab.tokens.iter().zip(&vocab.types) {
        match kind {
            TokenType::Control | TokenType::Unknown => {
                special.push(AddedToken::from(text.clone(), true));
            }
            TokenType::UserDefined => {
                user_defined.push(AddedToken::from(text.clone(), false).normalized(false));
            }
            TokenType::Normal | TokenType::Other => {}
        }
    }
    inner.add_special_tokens(&special);
    inner.add_tokens(&user_defined);
}

fn end_of_turn_tokens(vocab: &GgufVocab) -> impl Iterator<Item = u32> + '_ {
    vocab
        .tokens
        .iter()
        .zip(&vocab.types)
        .enumerate()
        .filter(|(_, (text, kind))| {
            **kind == TokenType::Control && END_OF_TURN_TEXTS.contains(&text.as_str())
        })
        .map(|(id, _)| id as u32)
}

// Typed reads of metadata values: a missing key is `None`, a key of the wrong
// type an error that names it.

fn wrong_type(key: &str, expected: &str) -> Error {
    Error::Tokenizer(format!("{key} is not {expected}"))
}

fn get_str<'a>(file: &'a GgufFile, key: &str) -> Result<Option<&'a str>> {
    file.get(key)
        .map(|value| value.as_str().ok_or_else(|| wrong_type(key, "a string")))
        .transpose()
}

fn get_bool(file: &GgufFile, key: &str) -> Result<Option<bool>> {
    match file.get(key) {
        None => Ok(None),
        Some(GgufValue::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(wrong_type(key, "a boolean")),
    }
}

/// A token id key, checked to lie inside the vocabulary.
fn special_id(file: &GgufFile, key: &str, token_count: usize) -> Result<Option<u32>> {
    let Some(value) = file.get(key) else {
        return Ok(None);
    };
    match value.as_usize() {
        Some(id) if id < token_count => Ok(Some(id as u32)),
        _ => Err(Error::Tokenizer(format!(
            "{key} = {} is not a token id of the vocabulary ({token_count} tokens)",
            value.brief()
        ))),
    }
}

/// An array key's elements, read by `elements` (`None` when of the wrong type).
fn array_of<'a, T>(
    file: &'a GgufFile,
    key: &str,
    expected: &str,
    elements: impl Fn(&'a GgufArray) -> Option<T>,
) -> Result<Option<T>> {
    let Some(value) = file.get(key) else {
        return Ok(None);
    };
    value
        .as_array()
        .and_then(elements)
        .map(Some)
        .ok_or_else(|| wrong_type(key, expected))
}

fn string_array<'a>(file: &'a GgufFile, key: &str) -> Result<Option<Vec<&'a str>>> {
    array_of(file, key, "an array of strings", |items| {
        items.as_strings().map(|strings| strings.iter().collect())
    })
}

fn int_array(file: &GgufFile, key: &str) -> Result<Option<Vec<usize>>> {
    array_of(
        file,
        key,
        "an array of non-negative integers",
        GgufArray::to_usizes,
    )
}

/// Scores are `f32`, or `i32` in some converted files (llama.cpp accepts both).
fn float_array(file: &GgufFile, key: &str) -> Result<Option<Vec<f32>>> {
    array_of(file, key, "an array of numbers", |items| match items {
        GgufArray::I32(v) => Some(v.iter().map(|&x| x as f32).collect()),
        _ => items.to_f32s(),
    })
}
