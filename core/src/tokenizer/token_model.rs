//! The model inside every [`super::Tokenizer`]: one of the `tokenizers`
//! crate's own (from `tokenizer.json`, or byte-level BPE from GGUF), or
//! Tandem's [`SentencePieceBpe`] for GGUF SentencePiece vocabularies. The
//! `tokenizers` pipeline around it (added tokens, normalizers, decoders) is
//! the same for both.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use tokenizers::decoders::DecoderWrapper;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::{AddedToken, Model, ModelWrapper, Token, TokenizerImpl, Trainer};

use super::sentencepiece::SentencePieceBpe;

/// The `tokenizers` pipeline over a [`TokenModel`].
pub(super) type Pipeline = TokenizerImpl<
    TokenModel,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

#[derive(Clone)]
pub(super) enum TokenModel {
    /// Shared, like the other: the tokenizer that reads special tokens as
    /// text is a clone, and a clone of the maps would double their memory.
    Library(Arc<ModelWrapper>),
    SentencePiece(SentencePieceBpe),
}

impl From<ModelWrapper> for TokenModel {
    fn from(model: ModelWrapper) -> Self {
        TokenModel::Library(Arc::new(model))
    }
}

impl Model for TokenModel {
    type Trainer = NoTrainer;

    fn tokenize(&self, sequence: &str) -> tokenizers::Result<Vec<Token>> {
        match self {
            TokenModel::Library(m) => m.tokenize(sequence),
            TokenModel::SentencePiece(m) => Ok(m.tokenize(sequence)),
        }
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        match self {
            TokenModel::Library(m) => m.token_to_id(token),
            TokenModel::SentencePiece(m) => m.id(token),
        }
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        match self {
            TokenModel::Library(m) => m.id_to_token(id),
            TokenModel::SentencePiece(m) => m.piece(id).map(str::to_string),
        }
    }

    fn get_vocab(&self) -> HashMap<String, u32> {
        match self {
            TokenModel::Library(m) => m.get_vocab(),
            TokenModel::SentencePiece(m) => m.vocab(),
        }
    }

    fn get_vocab_size(&self) -> usize {
        match self {
            TokenModel::Library(m) => m.get_vocab_size(),
            TokenModel::SentencePiece(m) => m.len(),
        }
    }

    fn save(&self, folder: &Path, prefix: Option<&str>) -> tokenizers::Result<Vec<PathBuf>> {
        match self {
            TokenModel::Library(m) => m.save(folder, prefix),
            TokenModel::SentencePiece(m) => m.to_bpe()?.save(folder, prefix),
        }
    }

    fn get_trainer(&self) -> NoTrainer {
        NoTrainer
    }
}

/// `tokenizer.json` holds a SentencePiece vocabulary as the equivalent BPE
/// model with its merges listed, which any `tokenizers` user can load.
impl Serialize for TokenModel {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            TokenModel::Library(m) => m.as_ref().serialize(serializer),
            TokenModel::SentencePiece(m) => {
                let bpe = m.to_bpe().map_err(serde::ser::Error::custom)?;
                ModelWrapper::BPE(bpe).serialize(serializer)
            }
        }
    }
}

impl<'de> Deserialize<'de> for TokenModel {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        ModelWrapper::deserialize(deserializer).map(TokenModel::from)
    }
}

/// Tandem loads tokenizers and never trains one; `tokenizers`' `Model`
/// trait still names a trainer type, and this one refuses.
pub(super) struct NoTrainer;

impl Trainer for NoTrainer {
    type Model = TokenModel;

    fn should_show_progress(&self) -> bool {
        false
    }

    fn train(&self, _: &mut TokenModel) -> tokenizers::Result<Vec<AddedToken>> {
        Err("Tandem does not train tokenizers".into())
    }

    fn feed<I, S, F>(&mut self, _: I, _: F) -> tokenizers::Result<()>
    where
        I: Iterator<Item = S> + Send,
        S: AsRef<str> + Send,
        F: Fn(&str) -> tokenizers::Result<Vec<String>> + Sync,
    {
        Err("Tandem does not train tokenizers".into())
    }
}
